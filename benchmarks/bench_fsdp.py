"""FSDP2 throughput: ``ddpkit.wrap(model, "fsdp")`` vs ``fully_shard`` by hand vs Accelerate.

Launch with two processes (or one per GPU)::

    ddpkit run --nproc-per-node 2 benchmarks/bench_fsdp.py [--trials 7] [--precision bf16]
    ddpkit run --nproc-per-node gpu benchmarks/bench_fsdp.py --device cuda --width 2048

The same model (``--blocks`` residual blocks of ``Linear(width, width)``), the same per-rank
batches and Adam, sharded three ways in one process group: plain torch (``fully_shard`` on each
block, then on the root: what ddpkit does, written by hand), ddpkit (``ddpkit.wrap(model,
"fsdp", fsdp_blocks=(Block,))``) and Hugging Face Accelerate's FSDP2 path
(``FullyShardedDataParallelPlugin(fsdp_version=2)``, its ``transformer_based_wrap`` on the
same block class, ``Accelerator.prepare``, ``accelerator.backward``). With ``--precision bf16``
each gets the same ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.

Accelerate is optional (``pip install ddpkit[bench]``): not installed, it has no row and a
note says so. Accelerate takes the FSDP path on GPUs only (on a CPU its state says
``MULTI_CPU`` and ``prepare`` would leave the model unsharded): on a CPU this bench sets its
state's ``distributed_type`` to FSDP before ``prepare``, which then runs Accelerate's own
``fsdp2_prepare_model`` (the same ``fully_shard`` calls, over gloo). The CPU figures compare
the wrappers' overhead around the same collectives; the GPU ones are the figures users see.

The variants run in turn, the first one rotating from trial to trial; rank 0 prints
steps/s per trial, the medians, and the ratios of ddpkit to plain torch and to Accelerate.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

import benchjson
import torch
import torch.distributed as dist
from bench_fsdp_memory import Block  # the same residual block, FSDP2's unit
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ddpkit

# report-launcher: ddpkit run --nproc-per-node 2

Batches = list[torch.Tensor]
Run = Callable[[], None]  # every batch once: forward, backward, an optimizer step


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(args.width) for _ in range(args.blocks)))


def policy(args: argparse.Namespace) -> MixedPrecisionPolicy | None:
    if args.precision != "bf16":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def loop(model: nn.Module, batches: Batches, backward: Callable[[torch.Tensor], Any]) -> Run:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def run() -> None:
        for x in batches:
            backward(model(x).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def plain_variant(args: argparse.Namespace, device: torch.device, batches: Batches) -> Run:
    model = make_model(args).to(device)
    mp = policy(args) or MixedPrecisionPolicy()
    for block in model:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return loop(model, batches, torch.Tensor.backward)


def ddpkit_variant(args: argparse.Namespace, device: torch.device, batches: Batches) -> Run:
    model = ddpkit.wrap(make_model(args), "fsdp", fsdp_blocks=(Block,), precision=args.precision)
    return loop(model, batches, torch.Tensor.backward)


def accelerate_variant(args: argparse.Namespace, device: torch.device, batches: Batches) -> Run:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        reshard_after_forward=True,
        mixed_precision_policy=policy(args),
    )
    if device.type == "cuda":
        accelerator = Accelerator(fsdp_plugin=plugin)  # adopts the existing process group
    else:  # Accelerate's FSDP path is for GPUs; the same fully_shard calls run on gloo
        accelerator = Accelerator(cpu=True)
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    model = make_model(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    sharded = [type(m).__name__ for m in model.modules()].count("FSDPBlock")
    if sharded != args.blocks:
        raise SystemExit(f"accelerate sharded {sharded} blocks, not {args.blocks}")

    def run() -> None:
        for x in batches:
            accelerator.backward(model(x).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


VARIANTS = {
    "plain torch": plain_variant,
    "ddpkit": ddpkit_variant,
    "accelerate": accelerate_variant,
}


def timed(run: Run, device: torch.device) -> float:
    dist.barrier()
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per trial")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--precision", choices=["bf16"], default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--no-peers", action="store_true", help="plain torch and ddpkit only")
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.trials, args.steps = min(args.trials, 2), min(args.steps, 4)

    ctx = ddpkit.init(device=args.device)
    if ctx.world_size < 2:
        raise SystemExit("run me with at least 2 processes: ddpkit run --nproc-per-node 2 ...")
    names, notes = ["plain torch", "ddpkit"], []
    if args.no_peers:
        notes.append("accelerate: not run (--no-peers)")
    elif importlib.util.find_spec("accelerate") is None:
        notes.append("accelerate: not installed (pip install ddpkit[bench])")
    else:
        names.append("accelerate")
    if "accelerate" in names and ctx.device.type != "cuda":
        notes.append("accelerate on CPU: its state set to FSDP by hand (it takes FSDP on GPUs)")
    gen = torch.Generator().manual_seed(ctx.rank)
    batches = [
        torch.randn(args.batch_size, args.width, generator=gen).to(ctx.device)
        for _ in range(args.steps)
    ]
    runs = {name: VARIANTS[name](args, ctx.device, batches) for name in names}
    for name in names:  # warm-up: the first step allocates the unsharded buffers and Adam's state
        timed(runs[name], ctx.device)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for trial in range(args.trials):
        shift = trial % len(names)
        for name in names[shift:] + names[:shift]:
            rates[name].append(args.steps / timed(runs[name], ctx.device))
        ddpkit.print(f"trial {trial}: " + "   ".join(
            f"{name} {rates[name][-1]:7.2f}" for name in names) + " steps/s")  # fmt: skip
    median = {name: statistics.median(rates[name]) for name in names}
    for name in names:
        ratio = median["ddpkit"] / median[name]
        ddpkit.print(f"median: {name:12} {median[name]:7.2f} steps/s, ddpkit / {name} {ratio:.3f}")
    for note in notes:
        ddpkit.print(note)
    params = sum(p.numel() for p in make_model(args).parameters()) / 1e6
    where = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU"
    figure = (
        f"FSDP2, {args.blocks} blocks of Linear({args.width}), {params:.1f} M parameters, "
        f"batch {args.batch_size}, {args.precision or 'fp32'}, {ctx.world_size} ranks on {where}"
    )
    rows = [
        benchjson.row(figure, name, median[name], "steps/s", True, trials=rates[name])
        for name in names
    ]
    rows[0]["baseline"] = True
    if ctx.rank == 0:
        title = "FSDP2 throughput: ddpkit.wrap(model, 'fsdp') vs fully_shard by hand vs Accelerate"
        launcher = f"ddpkit run --nproc-per-node {ctx.world_size}"
        benchjson.write(args.json, "fsdp", title, launcher, rows, notes=notes)


if __name__ == "__main__":
    main()
