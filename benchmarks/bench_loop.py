"""Training-loop throughput: ddpkit vs the same loop in plain torch DDP, Accelerate and Fabric.

Launch with two processes, e.g.::

    ddpkit run --nproc-per-node 2 benchmarks/bench_loop.py [--trials 7] [--model small|large|both]
    torchrun --nproc-per-node 2 benchmarks/bench_loop.py      # same figures

Every variant writes the same loop (model, data, per-rank batch size, SGD, one epoch per
trial) its own way, in one process group: plain torch (``DistributedDataParallel``,
``DistributedSampler`` and ``set_epoch`` by hand), ddpkit (``wrap``, ``loader``), Hugging Face
Accelerate (``Accelerator.prepare``, ``accelerator.backward``) and Lightning Fabric
(``fabric.setup``, ``setup_dataloaders``, ``fabric.backward``). Accelerate and Fabric are
optional (``pip install ddpkit[bench]``): a peer that is not installed has no row, and a note
says so. The variants run in turn, the first one rotating from trial to trial, so that machine
noise hits all alike. Two models: ``small`` (a 32-128-128-4 MLP: per-step overhead shows) and
``large`` (a 256-1024-1024-1024-4 MLP, 2.4 M parameters: gradient all-reduce dominates).
Rank 0 prints samples/s per trial, the medians and the ratios ddpkit / plain (goal: >= 0.98).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import time
from collections.abc import Callable, Iterable

import benchjson
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit

# report-launcher: ddpkit run --nproc-per-node 2

MODELS = {  # name: (layer widths, samples per epoch, quick samples)
    "small": ([32, 128, 128, 4], 16384, 4096),
    "large": ([256, 1024, 1024, 1024, 4], 4096, 512),
}
PEERS = {"accelerate": "accelerate", "lightning fabric": "lightning_fabric"}

Epoch = Callable[[], int]  # one epoch; returns the samples this rank trained on


def make_model(widths: list[int]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def run_epoch(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    opt: torch.optim.Optimizer, backward: Callable[[torch.Tensor], None],
) -> int:  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    seen = 0
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        backward(loss_fn(model(x), y))
        opt.step()
        seen += len(y)
    return seen


def timed(epoch: Callable[[], int]) -> float:
    """Samples per second over all ranks for one epoch."""
    dist.barrier()
    start = time.perf_counter()
    seen = torch.tensor(epoch())
    dist.barrier()
    elapsed = time.perf_counter() - start
    dist.all_reduce(seen)
    return float(seen) / elapsed


def plain_variant(ctx: ddpkit.Context, widths: list[int], data: TensorDataset, batch: int) -> Epoch:
    model = DistributedDataParallel(make_model(widths))
    sampler = DistributedSampler(
        data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0
    )
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = iter(range(1, 1_000_000))

    def epoch() -> int:
        sampler.set_epoch(next(epochs))  # what everyone has to remember by hand
        return run_epoch(model, loader, opt, torch.Tensor.backward)

    return epoch


def ddpkit_variant(
    ctx: ddpkit.Context, widths: list[int], data: TensorDataset, batch: int
) -> Epoch:
    model = ddpkit.wrap(make_model(widths))
    loader = ddpkit.loader(data, batch, shuffle=True, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return lambda: run_epoch(model, loader, opt, torch.Tensor.backward)


def accelerate_variant(
    ctx: ddpkit.Context, widths: list[int], data: TensorDataset, batch: int
) -> Epoch:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # adopts the existing process group
    model = make_model(widths)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = accelerator.prepare(
        model, opt, DataLoader(data, batch_size=batch, shuffle=True)
    )
    return lambda: run_epoch(model, loader, opt, accelerator.backward)


def fabric_variant(
    ctx: ddpkit.Context, widths: list[int], data: TensorDataset, batch: int
) -> Epoch:
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=ctx.world_size, strategy="ddp")
    fabric.launch()  # under torchrun/ddpkit run: adopts the existing process group
    model = make_model(widths)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=batch, shuffle=True))
    return lambda: run_epoch(model, loader, opt, fabric.backward)


VARIANTS = {
    "plain torch": plain_variant,
    "ddpkit": ddpkit_variant,
    "accelerate": accelerate_variant,
    "lightning fabric": fabric_variant,
}


def bench_model(
    ctx: ddpkit.Context, name: str, variants: list[str], args: argparse.Namespace
) -> dict[str, list[float]]:
    widths, samples, quick_samples = MODELS[name]
    samples = quick_samples if args.quick else samples
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(samples, widths[0], generator=gen),
        torch.randint(0, widths[-1], (samples,), generator=gen),
    )
    epochs = {v: VARIANTS[v](ctx, widths, data, args.batch_size) for v in variants}
    for epoch in epochs.values():
        timed(epoch)  # warm-up
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for trial in range(args.trials):
        # Rotate which variant goes first so none always runs on a warmer machine.
        shift = trial % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            rates[variant].append(timed(epochs[variant]))
        shown = "   ".join(f"{v} {rates[v][-1]:9.0f} samples/s" for v in variants)
        ddpkit.print(f"{name} model, trial {trial}: {shown}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--no-peers", action="store_true", help="plain torch and ddpkit only")
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.trials = min(args.trials, 2)

    ctx = ddpkit.init()
    if ctx.world_size < 2:
        raise SystemExit("run me with at least 2 processes: ddpkit run --nproc-per-node 2 ...")
    variants, notes = ["plain torch", "ddpkit"], []
    for peer, module in PEERS.items():
        if args.no_peers:
            notes.append(f"{peer}: not run (--no-peers)")
        elif importlib.util.find_spec(module) is None:
            notes.append(f"{peer}: not installed (pip install ddpkit[bench])")
        else:
            variants.append(peer)
    rows = []
    for name in MODELS if args.model == "both" else [args.model]:
        rates = bench_model(ctx, name, variants, args)
        medians = {v: statistics.median(rates[v]) for v in variants}
        p, k = medians["plain torch"], medians["ddpkit"]
        ddpkit.print(
            f"{name} model, median: plain torch DDP {p:.0f} samples/s, ddpkit {k:.0f} samples/s, "
            f"ratio ddpkit/plain {k / p:.3f} (goal >= 0.98)"
        )
        for peer in variants[2:]:
            ddpkit.print(f"{name} model, median: {peer} {medians[peer]:.0f} samples/s, "
                         f"ratio ddpkit/{peer} {k / medians[peer]:.3f}")  # fmt: skip
        widths = "-".join(map(str, MODELS[name][0]))
        figure = f"training loop, {name} model (MLP {widths}), {ctx.world_size} ranks"
        rows += [
            benchjson.row(figure, v, medians[v], "samples/s", True, trials=rates[v])
            for v in variants
        ]
    for note in notes:
        ddpkit.print(note)
    if ctx.rank == 0:
        benchjson.write(
            args.json, "loop", "Training loop: the same loop in plain torch DDP, ddpkit and peers",
            f"ddpkit run --nproc-per-node {ctx.world_size}", rows, notes=notes,
        )  # fmt: skip


if __name__ == "__main__":
    main()
