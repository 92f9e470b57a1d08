"""Job payload for the real-SLURM tests: join the job with ddpkit.init(), report, all_reduce.

Prints one JSON line ``{"rank", "local_rank", "world_size", "node", "launcher", "master_port",
"sum"}`` where ``node`` is this host's name and ``sum`` the all_reduce of ``rank + 1`` over the
world (so the right answer is ``world_size * (world_size + 1) / 2``). ``--sleep S`` waits S
seconds after reporting, with the process group still up (a job to cancel); with
``--until FILE`` it stops waiting as soon as FILE exists (two jobs holding their ports at once,
until the test saw both report). ``--env NAME`` (repeatable) adds ``"env": {NAME: value or
null}``, the variables this rank was started with. Any other argument is ignored, so tests can
add a unique marker to find the job's processes with ``ps``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist

import ddpkit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--until", default=None)
    parser.add_argument("--env", action="append", default=[])
    opts, _ = parser.parse_known_args()  # unknown arguments are markers
    started_with = {name: os.environ.get(name) for name in opts.env}  # before init reads them
    ctx = ddpkit.init(backend="gloo")
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    report = {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "world_size": ctx.world_size,
        "node": socket.gethostname(),
        "launcher": ctx.info.launcher,
        "master_port": ctx.info.master_port,
        "sum": int(value.item()),
    }
    if opts.env:
        report["env"] = started_with
    print(json.dumps(report), flush=True)
    deadline = time.monotonic() + opts.sleep
    while time.monotonic() < deadline and not (opts.until and os.path.exists(opts.until)):
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
