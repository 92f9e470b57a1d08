"""all_reduce bandwidth: ``ddpkit doctor``'s sweep vs a plain torch loop vs a raw socket.

Run as one command (it spawns the ranks itself, gloo on 127.0.0.1)::

    python benchmarks/bench_allreduce.py [--nproc 2] [--runs 16] [--quick] [--json FILE]

For each message size (4 B .. 64 MiB; 4 B .. 4 MiB with ``--quick``) every trial measures the
doctor's sweep (:func:`ddpkit.tools.commtest.sweep`) and a plain torch loop written the obvious
way (``dist.all_reduce`` in a timed loop, same iterations) twice each, in the order A B B A (the
side that goes first alternating from trial to trial: keep ``--runs`` even), and a raw TCP
transfer of the same size from the last rank to rank 0 (one stream: what the link does without a
collective). Printed: the median
time and busbw (algbw x 2(n-1)/n, as nccl-tests) per size and variant, and the ratio
ddpkit / plain (the doctor must measure what torch does, so ~1.0 is the goal). ``--json FILE``
writes the figures for the report generator (x = message bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpkit.cluster.rendezvous.ports import free_port
from ddpkit.tools import commtest

DDPKIT = "ddpkit doctor all_reduce (gloo)"
PLAIN = "plain torch all_reduce (gloo)"
SOCKET = "raw socket, one TCP stream"


def plain_loop(size: int, quick: bool) -> float:
    """Seconds per all_reduce of ``size`` bytes, the slowest rank's, written without ddpkit."""
    tensor = torch.ones(max(1, size // 4))
    count = commtest.iterations(size, quick)
    for _ in range(2):
        dist.all_reduce(tensor)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        dist.all_reduce(tensor)
    elapsed = torch.tensor([(time.perf_counter() - start) / count], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    sizes = commtest.QUICK_SIZES if args.quick else commtest.FULL_SIZES
    times: dict[str, dict[int, list[float]]] = {DDPKIT: {}, PLAIN: {}, SOCKET: {}}
    try:
        for trial in range(args.runs):
            for size in sizes:
                # A B B A (B A A B the next trial): each variant's trial value is the mean of
                # one early and one late run, so a drift within the trial (the other rank
                # lagging after the socket transfer, the machine's other work) hits both alike
                first, second = (DDPKIT, PLAIN) if trial % 2 == 0 else (PLAIN, DDPKIT)
                runs: dict[str, list[float]] = {DDPKIT: [], PLAIN: []}
                for variant in (first, second, second, first):
                    if variant == DDPKIT:
                        row = commtest.sweep(torch.device("cpu"), (size,), quick=args.quick)[0]
                        runs[variant].append(row.time_us / 1e6)
                    else:
                        runs[variant].append(plain_loop(size, args.quick))
                for variant, seconds in runs.items():
                    times[variant].setdefault(size, []).append(statistics.fmean(seconds))
                gbps = commtest.socket_gbps("127.0.0.1", max(size, 4), 120.0)
                if rank == 0 and gbps:
                    times[SOCKET].setdefault(size, []).append(size / (gbps * 1e9))
        if rank == 0:
            Path(out).write_text(json.dumps({v: {str(s): t for s, t in d.items()}
                                             for v, d in times.items()}))  # fmt: skip
    finally:
        dist.destroy_process_group()


def rows(times: dict[str, dict[str, list[float]]], world: int) -> list[dict[str, Any]]:
    found = []
    for variant, per_size in times.items():
        for size_text, samples in per_size.items():
            size, seconds = int(size_text), statistics.median(samples)
            algbw = size / seconds / 1e9
            # a raw stream is the link itself: its bandwidth is what busbw compares with
            bus = algbw if variant == SOCKET else algbw * commtest.bus_factor(world)
            scale = (1.0 if variant == SOCKET else commtest.bus_factor(world)) * size / 1e9
            # every trial's value, in the order they ran (the two variants side by side in
            # each): the report calls ddpkit behind only when it was the worse one in most
            found += [
                {"figure": "all_reduce busbw", "variant": variant, "value": bus, "unit": "GB/s",
                 "higher_is_better": True, "x": float(size),
                 "trials": [scale / t for t in samples]},
                {"figure": "all_reduce time", "variant": variant, "value": seconds * 1e6,
                 "unit": "us", "higher_is_better": False, "x": float(size),
                 "trials": [t * 1e6 for t in samples]},
            ]  # fmt: skip
    return found


def report(found: list[dict[str, Any]]) -> None:
    table: dict[tuple[float, str], dict[str, float]] = {}
    for row in found:
        table.setdefault((row["x"], row["variant"]), {})[row["unit"]] = row["value"]
    print(f"{'size (B)':>10}  {'variant':<32} {'time (us)':>11} {'busbw (GB/s)':>13}")
    for (size, variant), values in sorted(table.items()):
        print(f"{int(size):>10}  {variant:<32} {values['us']:>11.1f} {values['GB/s']:>13.3f}")
    for size in sorted({x for x, _ in table}):
        ratio = table[size, PLAIN]["us"] / table[size, DDPKIT]["us"]
        print(f"{int(size):>10}  speed ddpkit / plain = {ratio:.2f} (goal ~1.0: same loop)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    # 16, not 6: the report calls ddpkit behind at a size where it was the worse one in 80% of
    # the trials; between two identical loops (a 64 MiB one varies +-10% from trial to trial
    # here) 5 of 6 comes by chance 11% of the time, at one of 13 sizes in most runs; 13 of 16,
    # 1% of the time (13% a run)
    parser.add_argument("--runs", type=int, default=16, help="trials, even (order alternates)")
    parser.add_argument("--quick", action="store_true", help="4 B .. 4 MiB, 2 trials")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    if args.quick:
        args.runs = 2
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "times.json")
        mp.spawn(worker, args=(args.nproc, free_port(), args, out), nprocs=args.nproc)
        found = rows(json.loads(Path(out).read_text()), args.nproc)
    report(found)
    if args.json:
        command = shlex.join(["python", "benchmarks/bench_allreduce.py", *sys.argv[1:]])
        Path(args.json).write_text(json.dumps({
            "bench": "allreduce",
            "title": f"all_reduce over gloo, {args.nproc} ranks on 127.0.0.1",
            "command": command,
            "rows": found,
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
