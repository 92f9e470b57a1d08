"""Gradient accumulation: ``ddpkit.accumulate`` (the sync skipped) vs a sync every micro-step.

Launch with two processes::

    ddpkit run --nproc-per-node 2 benchmarks/bench_accumulate.py [--trials 7] [--every 8]
    ddpkit run --nproc-per-node 2 benchmarks/bench_accumulate.py --strategy fsdp

The same DDP model (``--strategy fsdp``: FSDP2, ``wrap(model, "fsdp")``) (a 256-1024-1024-1024-4
MLP, 2.4 M parameters: the gradient all-reduce or reduce-scatter is a large share of a step on
gloo) trains on the same micro-batches, an optimizer step every ``--every`` micro-steps, three
ways: ``ddpkit.accumulate(model, every=k)`` (the sync skipped but on the window's last
micro-step), the skip written by hand (DDP's ``no_sync()``, FSDP2's
``set_requires_gradient_sync``: the reference for ddpkit's own cost), and a backward that syncs
on every micro-step (the baseline: the loop accelerate PR #1153 measured at 2.2x slower across
nodes). They run in turn, the first one rotating from trial to trial. Rank 0 prints
micro-steps/s per trial, the medians and the ratios to the baseline.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import benchjson
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import ddpkit

# report-launcher: ddpkit run --nproc-per-node 2

WIDTHS = [256, 1024, 1024, 1024, 4]
Batches = list[tuple[torch.Tensor, torch.Tensor]]
Run = Callable[[], None]  # every micro-batch once, an optimizer step per window


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def ddpkit_variant(model: nn.Module, batches: Batches, every: int) -> Run:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def run() -> None:
        for x, y in batches:
            with ddpkit.accumulate(model, every=every) as micro:
                F.cross_entropy(model(x), y).backward()
            if micro.sync:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    return run


def no_sync_variant(model: nn.Module, batches: Batches, every: int) -> Run:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    fsdp = hasattr(model, "set_requires_gradient_sync")

    def run() -> None:
        for number, (x, y) in enumerate(batches):
            final = (number + 1) % every == 0
            if fsdp:
                model.set_requires_gradient_sync(final)  # type: ignore[operator]
            with nullcontext() if fsdp or final else model.no_sync():  # type: ignore[operator]
                (F.cross_entropy(model(x), y) / every).backward()
            if final:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    return run


def sync_every_variant(model: nn.Module, batches: Batches, every: int) -> Run:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def run() -> None:
        for number, (x, y) in enumerate(batches):
            (F.cross_entropy(model(x), y) / every).backward()  # syncs every time
            if (number + 1) % every == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    return run


def timed(run: Run) -> float:
    dist.barrier()
    start = time.perf_counter()
    run()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--every", type=int, default=8, help="micro-steps per optimizer step")
    parser.add_argument("--windows", type=int, default=6, help="optimizer steps per trial")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.trials, args.windows = min(args.trials, 2), min(args.windows, 2)

    ctx = ddpkit.init()
    if ctx.world_size < 2:
        raise SystemExit("run me with at least 2 processes: ddpkit run --nproc-per-node 2 ...")
    model = ddpkit.wrap(make_model(), args.strategy)
    gen = torch.Generator().manual_seed(ctx.rank)
    micro_steps = args.windows * args.every
    batches = [
        (torch.randn(args.micro_batch, WIDTHS[0], generator=gen),
         torch.randint(0, WIDTHS[-1], (args.micro_batch,), generator=gen))
        for _ in range(micro_steps)
    ]  # fmt: skip
    by_hand = "plain torch no_sync" if args.strategy == "ddp" else "plain torch FSDP2 skip"
    makers = {
        "ddpkit accumulate": ddpkit_variant,
        by_hand: no_sync_variant,
        "sync every micro-step": sync_every_variant,
    }
    runs = {name: make(model, batches, args.every) for name, make in makers.items()}
    names = list(runs)
    for name in names:  # warm-up: DDP's first backward builds its buckets (FSDP2's buffers)
        timed(runs[name])
    rates: dict[str, list[float]] = {name: [] for name in names}
    for trial in range(args.trials):
        shift = trial % len(names)
        for name in names[shift:] + names[:shift]:
            rates[name].append(micro_steps / timed(runs[name]))
        ddpkit.print(f"trial {trial}: " + "   ".join(
            f"{name} {rates[name][-1]:7.1f}" for name in names) + " micro-steps/s")  # fmt: skip
    median = {name: statistics.median(rates[name]) for name in names}
    base = median["sync every micro-step"]
    for name in names:
        ddpkit.print(
            f"median: {name:22} {median[name]:7.1f} micro-steps/s, "
            f"ratio to sync every micro-step {median[name] / base:.2f}"
        )
    ddpkit.print(
        f"ddpkit accumulate / {by_hand}: {median['ddpkit accumulate'] / median[by_hand]:.3f}"
    )
    figure = (
        f"accumulation k={args.every}, micro-batch {args.micro_batch}, 2.4 M parameters, "
        f"{ctx.world_size} ranks"
    ) + (", FSDP2" if args.strategy == "fsdp" else "")
    rows = [
        benchjson.row(figure, name, median[name], "micro-steps/s", True, trials=rates[name])
        for name in names
    ]
    rows[-1]["baseline"] = True
    if ctx.rank == 0:
        title = "Gradient accumulation: ddpkit.accumulate (no_sync) vs a sync every micro-step"
        if args.strategy == "fsdp":
            title = "FSDP2 gradient accumulation: ddpkit.accumulate vs a sync every micro-step"
        launcher = f"ddpkit run --nproc-per-node {ctx.world_size}"
        benchjson.write(args.json, "accumulate", title, launcher, rows)


if __name__ == "__main__":
    main()
