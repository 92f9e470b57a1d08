"""A job stuck in a collective, for the hang report check of ci/gpu-check.sh (issue 49).

One rank on NCCL: ``init()`` starts no watchdog at world size 1 (there is no peer to wait
for), so this script starts ddpkit's own one (``watchdog.start``, as ``init`` does at world
size 2 and up, on a TCP store of its own: the group's is a HashStore at world size 1; torch's
flight recorder is on through ``TORCH_FR_BUFFER_SIZE``), then holds
an NCCL all_reduce in flight: a GPU kernel that spins (``torch.cuda._sleep``) runs ahead of it
on the stream, so the collective is enqueued and not completed for ``--hold`` seconds while
the main thread waits for it. The report (stderr) must name the all_reduce as the flight
recorder has it; ci/gpu-check.sh reads the log. The script also prints the recorder's entry.

``--cpu-dry``, under ``ddpkit run --nproc-per-node 2`` on gloo: rank 1 sleeps while rank 0
waits in the all_reduce (gloo has no stream to hold one rank's collective open).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit import compat
from ddpkit.worker import watchdog

BOUND_S = 3.0


def spin_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds``."""
    cycles = 50_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds * 1000 / max(start.elapsed_time(end), 1e-3))


def in_flight_entry() -> str:
    dump = compat.flight_recorder(True) or {}
    entries = [e for e in dump.get("entries") or [] if isinstance(e, dict)]
    if not entries:
        return "no entry"
    last = entries[-1]
    keys = ("profiling_name", "collective_seq_id", "state", "input_sizes", "input_dtypes")
    return " ".join(f"{key}={last.get(key)!r}" for key in keys)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-dry", action="store_true")
    parser.add_argument("--hold", type=float, default=15.0, help="seconds in the collective")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # the recorder, at world size 1 too
    ctx = ddpkit.init(
        device="cpu" if args.cpu_dry else None,
        hang_timeout_s=BOUND_S,
        hang_first_timeout_s=BOUND_S,
    )
    print(f"init: {ctx.device} {ctx.backend} world {ctx.world_size}", flush=True)
    if ctx.world_size == 1:
        bounds = watchdog.hang_bounds(dict(os.environ), BOUND_S, BOUND_S, 1)
        # the group's store is a HashStore at world size 1: the watchdog needs a TCP one
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        watchdog.start(rank=0, world_size=1, bound_s=60.0, store=store, hangs=bounds)
    value = torch.ones(4, device=ctx.device)
    for _ in range(4):  # past the first step: the same collective completed twice
        dist.all_reduce(value)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    time.sleep(2 * BOUND_S)  # the watchdog sees the first step pass
    if ctx.device.type == "cuda":
        cycles = spin_cycles(args.hold)
        torch.cuda._sleep(cycles)
        work = dist.all_reduce(value, async_op=True)
        time.sleep(1.0)
        print(f"in flight: {in_flight_entry()}", flush=True)
        deadline = time.monotonic() + args.hold + 60
        while not work.is_completed() and time.monotonic() < deadline:  # bounded
            time.sleep(0.1)
        done = work.is_completed()
    elif ctx.rank == 1:
        time.sleep(args.hold)  # rank 0 waits in the all_reduce below meanwhile
        dist.all_reduce(value)
        done = True
    else:
        dist.all_reduce(value)
        done = True
    print(f"collective completed: {done}", flush=True)
    if ctx.world_size == 1:
        watchdog.stop("exited")
    ddpkit.shutdown()
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
