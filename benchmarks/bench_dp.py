"""DataParallel memory and speed: stock DP vs ddpkit's balanced DP vs DDP, per GPU.

    python benchmarks/bench_dp.py [--quick] [--trials 4] [--steps 20] [--json FILE]

A model whose output is large (a classifier over ``--classes`` outputs, as a language model's
vocabulary) trains with cross-entropy. Measured per variant: samples/s (median over trials)
and each GPU's peak allocated memory (``torch.cuda.max_memory_allocated``), the variants run
alternately, the order reversed every other trial.

- two or more GPUs: ``stock DP`` (``nn.DataParallel``, the loss on the gathered output),
  ``balanced DP`` (``ddpkit.wrap(model, "dp")`` + ``ddpkit.balanced_loss``: per-device losses,
  scalars gathered) and ``DDP`` (one process per GPU, nccl, the batch split among them);
- one GPU: what it allows: the engine with two slices on cuda:0, the outputs gathered and the
  loss computed on them (stock DP's way) vs the loss beside each slice (ddpkit's way);
- no GPU: nothing is measured; it says so, writes no rows and exits 0.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

import ddpkit
from ddpkit.worker.dataparallel import replicas_for, run_parallel, scatter_to
from ddpkit.worker.structure import concat

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _model(features: int, hidden: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def _measure(
    model: nn.Module, step: Step, batch: tuple[torch.Tensor, torch.Tensor], steps: int
) -> tuple[float, list[float]]:
    """(samples/s, peak MiB per GPU) of ``steps`` training steps after one warm-up step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = batch

    def one() -> None:
        optimizer.zero_grad(set_to_none=True)
        step(x, y).backward()
        optimizer.step()

    one()
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)
        torch.cuda.reset_peak_memory_stats(index)
    start = time.perf_counter()
    for _ in range(steps):
        one()
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)
    elapsed = time.perf_counter() - start
    peaks = [torch.cuda.max_memory_allocated(i) / 2**20 for i in range(torch.cuda.device_count())]
    return len(x) * steps / elapsed, peaks


def _variants(args: argparse.Namespace) -> dict[str, Callable[[], tuple[float, list[float]]]]:
    count = torch.cuda.device_count()
    first = torch.device("cuda", 0)
    x = torch.randn(args.batch_size, args.features, device=first)
    y = torch.randint(0, args.classes, (args.batch_size,), device=first)
    criterion = nn.CrossEntropyLoss()
    shape = (args.features, args.hidden, args.classes)

    def stock() -> tuple[float, list[float]]:
        model = nn.DataParallel(_model(*shape).to(first))
        return _measure(model, lambda a, b: criterion(model(a), b), (x, y), args.steps)

    def balanced() -> tuple[float, list[float]]:
        model = ddpkit.wrap(_model(*shape), "dp")
        return _measure(model, ddpkit.balanced_loss(model, criterion), (x, y), args.steps)

    def gathered_one_gpu() -> tuple[float, list[float]]:
        model = _model(*shape).to(first)
        devices = [first, first]

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            slices, _ = scatter_to(a, devices)
            replicas = replicas_for(model, devices[: len(slices)])
            outputs = run_parallel(lambda i: replicas[i](slices[i]), devices[: len(slices)])
            return criterion(concat(outputs), b)

        return _measure(model, step, (x, y), args.steps)

    def balanced_one_gpu() -> tuple[float, list[float]]:
        model = _model(*shape).to(first)
        step = ddpkit.balanced_loss(model, criterion, devices=[first, first])
        return _measure(model, step, (x, y), args.steps)

    if count == 1:
        return {
            "gathered output (1 GPU, 2 slices)": gathered_one_gpu,
            "per-slice losses (1 GPU, 2 slices)": balanced_one_gpu,
        }
    return {"stock DP": stock, "balanced DP": balanced, "DDP": lambda: _ddp(args, count)}


def _ddp(args: argparse.Namespace, count: int) -> tuple[float, list[float]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    workers = [
        context.Process(target=_ddp_worker, args=(rank, count, port, vars(args), results))
        for rank in range(count)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if any(worker.exitcode != 0 for worker in workers):
        raise RuntimeError("a DDP worker failed; see its output above")
    seen = sorted(results.get() for _ in range(count))
    elapsed = max(entry[1] for entry in seen)  # the slowest rank sets the pace
    rows = args.batch_size // count * count
    return rows * args.steps / elapsed, [entry[2] for entry in seen]


def _ddp_worker(rank: int, count: int, port: int, options: dict[str, Any], results: Any) -> None:
    import torch.distributed as dist

    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(count),
        "LOCAL_WORLD_SIZE": str(count),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    ddpkit.init(env=env)
    device = torch.device("cuda", rank)
    model = ddpkit.wrap(_model(options["features"], options["hidden"], options["classes"]))
    rows = options["batch_size"] // count
    x = torch.randn(rows, options["features"], device=device)
    y = torch.randint(0, options["classes"], (rows,), device=device)
    step = ddpkit.balanced_loss(model, nn.CrossEntropyLoss())  # plain criterion(model(x), y)
    _measure(model, step, (x, y), 1)  # the group's first collectives, before the clock
    dist.barrier()
    speed, peaks = _measure(model, step, (x, y), options["steps"])
    results.put((rank, rows * options["steps"] / speed, peaks[rank]))
    ddpkit.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 trials: < 1 min")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=32768)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.steps, args.batch_size, args.classes = 2, 5, 128, 8192
    command = " ".join(["python", "benchmarks/bench_dp.py", *sys.argv[1:]])
    rows: list[dict[str, Any]] = []
    if not torch.cuda.is_available():
        print(
            "bench_dp: no CUDA device here: measured nothing (stock vs balanced DataParallel "
            "and DDP need GPUs; no figures are made up)"
        )
    else:
        rows = _run(args)
    if args.json:
        report = {
            "bench": "dp",
            "title": "DataParallel: stock vs balanced vs DDP, per-GPU peak memory and samples/s",
            "command": command,
            "rows": rows,
        }
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
    return 0


def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    ddpkit.init(env={})
    variants = _variants(args)
    speeds: dict[str, list[float]] = {name: [] for name in variants}
    peaks: dict[str, list[float]] = {}
    for trial in range(args.trials):
        order = list(variants) if trial % 2 == 0 else list(reversed(variants))
        for name in order:
            speed, peak = variants[name]()
            speeds[name].append(speed)
            peaks[name] = [max(a, b) for a, b in zip(peaks.get(name, peak), peak, strict=True)]
            torch.cuda.empty_cache()
    rows: list[dict[str, Any]] = []
    baseline = next(iter(variants))
    for name in variants:
        median = statistics.median(speeds[name])
        ratio = median / statistics.median(speeds[baseline])
        shown = ", ".join(f"cuda:{i} {mib:.0f} MiB" for i, mib in enumerate(peaks[name]))
        print(f"{name}: {median:.0f} samples/s (x{ratio:.2f} vs {baseline}); peak {shown}")
        rows.append(
            {
                "figure": "samples/s",
                "variant": name,
                "value": median,
                "unit": "samples/s",
                "higher_is_better": True,
            }
        )
        rows.extend(
            {
                "figure": f"peak memory cuda:{i}",
                "variant": name,
                "value": mib,
                "unit": "MiB",
                "higher_is_better": False,
                "x": float(i),
            }
            for i, mib in enumerate(peaks[name])
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
