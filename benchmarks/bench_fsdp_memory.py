"""Memory per rank under FSDP2 against DDP: parameters, gradients and optimizer state.

    python benchmarks/bench_fsdp_memory.py [--worlds 1 2 4] [--width 512] [--blocks 8]
        [--device cuda] [--json FILE] [--quick]

Each world size runs twice on gloo over 127.0.0.1, CPU processes: a model of ``--blocks``
residual blocks (``Linear(width, width)``) wrapped with ``ddpkit.wrap(model, "ddp")`` and with
``ddpkit.wrap(model, "fsdp", fsdp_blocks=(Block,))``, two Adam steps. Then each rank counts the
bytes of the tensors it holds, by their local shard (``DTensor.to_local()``): the parameters,
their gradients and the optimizer's state (Adam: two moments and a step per parameter).
Not counted: DDP's gradient buckets (another gradient-sized copy under DDP), FSDP2's
all-gather buffers while a block runs (one block unsharded at a time), activations.

Printed per world size: the largest rank's bytes of each kind and their total, for DDP and
FSDP2, and the ratio FSDP2 / DDP beside 1/N. Counts, not timings: the figures do not depend on
the machine's load. ``--json`` writes each world size's totals for ``benchmarks/report.py``
(DDP the baseline, x = N); ``--quick`` counts a model of 2 blocks of width 128.

``--device cuda`` (one GPU a rank: ``--worlds 1`` on one GPU, over NCCL) adds what the counts
leave out: the CUDA allocator's peak while each strategy builds its model and takes two steps
(``torch.cuda.max_memory_allocated`` from a reset, less what was allocated before), so DDP's
gradient buckets and FSDP2's all-gather buffers are in it.
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

import benchjson
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

import ddpkit

KINDS = ("params", "grads", "optim")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    env = {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }  # fmt: skip
    device = ddpkit.init(env=env, device=args.device).device
    cuda = device.type == "cuda"
    try:
        for strategy in ("ddp", "fsdp"):
            if cuda:  # the peak from here on: this strategy's model, step and buffers alone
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            torch.manual_seed(0)
            model = nn.Sequential(*(Block(args.width) for _ in range(args.blocks)))
            options = {"fsdp_blocks": (Block,)} if strategy == "fsdp" else {}
            model = ddpkit.wrap(model, strategy, **options)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            for _ in range(2):  # the second step: Adam's state exists, the buckets are built
                model(torch.randn(8, args.width, device=device)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
            counted = {
                "params": sum(_local_bytes(p) for p in model.parameters()),
                "grads": sum(_local_bytes(p.grad) for p in model.parameters()),
                "optim": sum(
                    _local_bytes(value)
                    for state in optimizer.state.values()
                    for value in state.values()
                    if isinstance(value, torch.Tensor)
                ),
            }
            if cuda:  # what the allocator saw: DDP's buckets, FSDP2's all-gathers, activations
                counted["peak"] = torch.cuda.max_memory_allocated(device) - before
            out.put((world, strategy, rank, counted))
            del model, optimizer
    finally:
        ddpkit.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.width, args.blocks = 128, 2
    if args.device == "cuda" and max(args.worlds) > torch.cuda.device_count():
        gpus = torch.cuda.device_count()
        raise SystemExit(f"--device cuda: one GPU a rank, {gpus} GPUs for --worlds {args.worlds}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.get_context("spawn")
    queue = context.Queue()
    rows: dict[tuple[int, str], dict[str, int]] = {}
    peaks: dict[tuple[int, str], int] = {}  # --device cuda: the allocator's peak, largest rank
    for world in args.worlds:
        port = _free_port()
        ranks = [
            context.Process(target=_rank, args=(rank, world, port, args, queue))
            for rank in range(world)
        ]
        for process in ranks:
            process.start()
        for _ in range(2 * world):
            got_world, strategy, _, counted = queue.get(timeout=600)
            largest = rows.setdefault((got_world, strategy), dict.fromkeys(KINDS, 0))
            for kind in KINDS:
                largest[kind] = max(largest[kind], counted[kind])
            if "peak" in counted:
                key = (got_world, strategy)
                peaks[key] = max(peaks.get(key, 0), counted["peak"])
        for process in ranks:
            process.join()
            if process.exitcode != 0:
                raise SystemExit(f"a rank of world {world} exited {process.exitcode}")
    mib = 2**20
    print(f"model: {args.blocks} blocks of Linear({args.width}, {args.width}), Adam; MiB per rank")
    print(f"{'N':>2} {'strategy':8} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} ratio 1/N")
    for world in args.worlds:
        ddp = sum(rows[(world, "ddp")].values())
        for strategy in ("ddp", "fsdp"):
            row = rows[(world, strategy)]
            total = sum(row.values())
            figures = " ".join(f"{row[kind] / mib:8.2f}" for kind in KINDS)
            ratio = f" {total / ddp:5.3f} {1 / world:5.3f}" if strategy == "fsdp" else ""
            print(f"{world:>2} {strategy:8} {figures} {total / mib:8.2f}{ratio}")
    for world in args.worlds:
        if (world, "ddp") in peaks:
            ddp, fsdp = peaks[(world, "ddp")], peaks[(world, "fsdp")]
            print(
                f"{world:>2} peak CUDA memory allocated ({torch.cuda.get_device_name()}): "
                f"DDP {ddp / mib:.2f} MiB, FSDP2 {fsdp / mib:.2f} MiB, FSDP2 / DDP {fsdp / ddp:.3f}"
            )
    figure = f"{args.blocks} blocks of Linear({args.width}, {args.width}), Adam: MiB a rank"
    out = []
    for world in args.worlds:
        for strategy, name in (("ddp", "DDP"), ("fsdp", "ddpkit FSDP2")):
            total = sum(rows[(world, strategy)].values()) / mib
            out.append(benchjson.row(figure, name, total, "MiB", False, x=world))
            if strategy == "ddp":
                out[-1]["baseline"] = True
    for (world, strategy), peak in sorted(peaks.items()):
        name = "DDP" if strategy == "ddp" else "ddpkit FSDP2"
        where = f"{figure}, peak CUDA memory allocated on {torch.cuda.get_device_name()}"
        row = benchjson.row(where, name, peak / mib, "MiB", False, x=world)
        row["baseline"] = strategy == "ddp"
        out.append(row)
    title = "FSDP2 memory per rank (parameters, gradients, optimizer state) against DDP"
    benchjson.write(args.json, "fsdp_memory", title, "python", out)


if __name__ == "__main__":
    main()
