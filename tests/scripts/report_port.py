"""Job payload for the port-collision tests: join with ddpkit.init(), all_reduce, report.

Prints one JSON line ``{"rank", "world_size", "node", "master_port", "resv_ports", "sum",
"ddpkit"}``: the port the rank joined on, the reservation SLURM gave the step (None without
one) and where ddpkit was imported from (the tests check that it is the checkout under test).
"""

from __future__ import annotations

import json
import os
import socket

import torch
import torch.distributed as dist

import ddpkit


def main() -> None:
    ctx = ddpkit.init(backend="gloo")
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    report = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "node": socket.gethostname(),
        "master_port": ctx.info.master_port,
        "resv_ports": os.environ.get("SLURM_STEP_RESV_PORTS"),
        "sum": int(value.item()),
        "ddpkit": ddpkit.__file__,
    }
    print(json.dumps(report), flush=True)
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
