"""Evaluation over an epoch: ``ddpkit.gather`` vs Accelerate's ``gather_for_metrics``.

Launch with two processes::

    ddpkit run --nproc-per-node 2 benchmarks/bench_eval.py [--trials 7] [--samples 20001]

Each variant runs the same evaluation (a 32-128-128-4 MLP, per-sample hits gathered from every
rank after each batch) over a test set whose size divides by neither the world size nor the
batch size: ddpkit (``ddpkit.loader`` + ``ddpkit.gather``), Accelerate (``prepare``d
DataLoader + ``accelerator.gather_for_metrics``; optional, ``pip install ddpkit[bench]``) and
plain torch (``DistributedSampler`` + ``dist.all_gather``, which counts the sampler's padding
twice: the baseline of what it costs to do nothing about it). They run in turn, the first one
rotating from trial to trial. Rank 0 prints samples/s per trial, the medians, the ratios and
how many samples each variant counted (the set's size, except plain torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable

import benchjson
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit

# report-launcher: ddpkit run --nproc-per-node 2

Epoch = Callable[[], int]  # one pass; returns the samples counted (over all ranks)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4)
    ).eval()


def ddpkit_variant(model: nn.Module, data: TensorDataset, batch: int) -> Epoch:
    loader = ddpkit.loader(data, batch, shuffle=False)

    @torch.no_grad()
    def epoch() -> int:
        counted = 0
        for x, y in loader:
            counted += ddpkit.gather((model(x).argmax(1) == y).long()).numel()
        return counted

    return epoch


def accelerate_variant(model: nn.Module, data: TensorDataset, batch: int) -> Epoch:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # adopts the existing process group
    loader = accelerator.prepare(DataLoader(data, batch_size=batch, shuffle=False))

    @torch.no_grad()
    def epoch() -> int:
        counted = 0
        for x, y in loader:
            counted += accelerator.gather_for_metrics((model(x).argmax(1) == y).long()).numel()
        return counted

    return epoch


def plain_variant(model: nn.Module, data: TensorDataset, batch: int) -> Epoch:
    world = dist.get_world_size()
    sampler = DistributedSampler(data, num_replicas=world, rank=dist.get_rank(), shuffle=False)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)

    @torch.no_grad()
    def epoch() -> int:
        counted = 0
        for x, y in loader:
            hits = (model(x).argmax(1) == y).long()
            everyone = [torch.empty_like(hits) for _ in range(world)]
            dist.all_gather(everyone, hits)  # same-size batches on every rank with padding
            counted += sum(part.numel() for part in everyone)
        return counted

    return epoch


def timed(epoch: Epoch) -> tuple[float, int]:
    dist.barrier()
    start = time.perf_counter()
    counted = epoch()
    dist.barrier()
    return time.perf_counter() - start, counted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--samples", type=int, default=20001)
    parser.add_argument("--batch-size", type=int, default=64)
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.trials, args.samples = min(args.trials, 2), min(args.samples, 4001)

    ctx = ddpkit.init()
    if ctx.world_size < 2:
        raise SystemExit("run me with at least 2 processes: ddpkit run --nproc-per-node 2 ...")
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(args.samples, 32, generator=gen), torch.randint(0, 4, (args.samples,))
    )
    model = make_model()
    makers = {"ddpkit": ddpkit_variant, "plain torch": plain_variant}
    notes = []
    if importlib.util.find_spec("accelerate") is None:
        notes.append("accelerate: not installed (pip install ddpkit[bench])")
    else:
        makers = {"accelerate": accelerate_variant, **makers}
    epochs = {name: make(model, data, args.batch_size) for name, make in makers.items()}
    names = list(epochs)
    counted = {name: timed(epochs[name])[1] for name in names}  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in names}
    for trial in range(args.trials):
        shift = trial % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, _ = timed(epochs[name])
            rates[name].append(args.samples / seconds)
        ddpkit.print(f"trial {trial}: " + "   ".join(
            f"{name} {rates[name][-1]:9.0f} samples/s" for name in names))  # fmt: skip
    median = {name: statistics.median(rates[name]) for name in names}
    for name in names:
        ddpkit.print(
            f"median: {name} {median[name]:.0f} samples/s, ratio ddpkit/{name} "
            f"{median['ddpkit'] / median[name]:.3f}; counted {counted[name]} of {args.samples}"
        )
    for note in notes:
        ddpkit.print(note)
    figure = f"evaluation epoch, {args.samples} samples, gather per batch, {ctx.world_size} ranks"
    rows = [
        benchjson.row(figure, name, median[name], "samples/s", True, trials=rates[name])
        for name in names
    ]
    notes.append(
        "plain torch (dist.all_gather) counts "
        f"{counted['plain torch'] - args.samples} padded samples twice; ddpkit counted "
        f"{counted['ddpkit']}"
        + (f", accelerate {counted['accelerate']}" if "accelerate" in counted else "")
    )
    if ctx.rank == 0:
        title = "Evaluation: ddpkit.gather vs Accelerate's gather_for_metrics"
        launcher = f"ddpkit run --nproc-per-node {ctx.world_size}"
        benchjson.write(args.json, "eval", title, launcher, rows, notes=notes)


if __name__ == "__main__":
    main()
