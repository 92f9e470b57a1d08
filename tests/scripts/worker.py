"""Worker for tests/launch/test_run.py: a gloo all_reduce, numbered output lines, optional failures.

Run under ``ddpkit run``; prints ``env RANK=.. LOCAL_RANK=.. WORLD_SIZE=..``, ``line <rank> <i>``
for i < --lines, ``args <json of sys.argv[1:]>`` and ``sum <all_reduce of rank + 1>``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--record", action="store_true")
    opts, _ = parser.parse_known_args()  # the rest is pass-through checked via "args"
    rank = int(os.environ["RANK"])
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")
    print("env " + " ".join(f"{k}={os.environ[k]}" for k in keys))
    print("args " + json.dumps(sys.argv[1:]))
    for i in range(opts.lines):
        print(f"line {rank} {i}")
        print(f"eline {rank} {i}", file=sys.stderr)
    dist.init_process_group("gloo")
    try:
        if rank == opts.fail_rank:
            raise ValueError(f"boom from rank {rank}")
        if rank == opts.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        print(f"sum {int(value.item())}")
    finally:
        if rank != opts.fail_rank:
            dist.destroy_process_group()


if __name__ == "__main__":
    if "--record" in sys.argv:
        record(main)()
    else:
        main()
