"""Training-loop throughput: ddpkit (init / wrap / loader) vs the same loop in plain torch DDP.

Launch with two processes, e.g.::

    ddpkit run --nproc-per-node 2 benchmarks/bench_loop.py
    torchrun --nproc-per-node 2 benchmarks/bench_loop.py      # same figures

Both loops use the same process group, model, data, batch size and optimizer, and run
alternately (plain, ddpkit, ddpkit, plain, ...) so that machine noise hits both alike. Rank 0
prints samples/s per trial, the medians and the ratio ddpkit / plain (goal: >= 0.98).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4)
    )


def epoch_plain(
    model: nn.Module,
    data: DataLoader,
    sampler: DistributedSampler,
    epoch: int,
    opt: torch.optim.Optimizer,
) -> int:
    sampler.set_epoch(epoch)  # what everyone has to remember by hand
    loss_fn = nn.CrossEntropyLoss()
    seen = 0
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        seen += len(y)
    return seen


def epoch_ddpkit(model: nn.Module, data: DataLoader, opt: torch.optim.Optimizer) -> int:
    loss_fn = nn.CrossEntropyLoss()
    seen = 0
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        seen += len(y)
    return seen


def timed(fn: object, *args: object) -> float:
    """Samples per second over all ranks for one epoch of ``fn``."""
    dist.barrier()
    start = time.perf_counter()
    seen = torch.tensor(fn(*args))  # type: ignore[operator]
    dist.barrier()
    elapsed = time.perf_counter() - start
    dist.all_reduce(seen)
    return float(seen) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    ctx = ddpkit.init()
    if ctx.world_size < 2:
        raise SystemExit("run me with at least 2 processes: ddpkit run --nproc-per-node 2 ...")
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(args.samples, 32, generator=gen),
        torch.randint(0, 4, (args.samples,), generator=gen),
    )

    plain_model = DistributedDataParallel(make_model())
    plain_sampler = DistributedSampler(
        data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0
    )
    plain_data = DataLoader(data, batch_size=args.batch_size, sampler=plain_sampler)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01)

    kit_model = ddpkit.wrap(make_model())
    kit_data = ddpkit.loader(data, args.batch_size, shuffle=True, seed=0)
    kit_opt = torch.optim.SGD(kit_model.parameters(), lr=0.01)

    timed(epoch_plain, plain_model, plain_data, plain_sampler, 0, plain_opt)  # warm-up
    timed(epoch_ddpkit, kit_model, kit_data, kit_opt)
    plain: list[float] = []
    kit: list[float] = []
    for trial in range(args.trials):
        # Alternate which loop goes first so neither always runs on a warmer machine.
        runs = [
            lambda epoch=trial + 1: plain.append(
                timed(epoch_plain, plain_model, plain_data, plain_sampler, epoch, plain_opt)
            ),
            lambda: kit.append(timed(epoch_ddpkit, kit_model, kit_data, kit_opt)),
        ]
        for run in runs if trial % 2 == 0 else runs[::-1]:
            run()
        ddpkit.print(
            f"trial {trial}: plain {plain[-1]:9.0f} samples/s   ddpkit {kit[-1]:9.0f} samples/s"
        )
    p, k = statistics.median(plain), statistics.median(kit)
    ddpkit.print(
        f"median: plain torch DDP {p:.0f} samples/s, ddpkit {k:.0f} samples/s, "
        f"ratio ddpkit/plain {k / p:.3f} (goal >= 0.98)"
    )


if __name__ == "__main__":
    main()
