"""Job payload for tests/worker/test_ifname_cluster.py: one rank a node forms a gloo group and
all_reduces ``rank + 1``, either through ``ddpkit.init()`` or, with ``--plain``, through torch
alone (``init_process_group("gloo", init_method="env://")``; the rank and world size are
RANK and WORLD_SIZE where a launcher set them, else SLURM's). Both read MASTER_ADDR and
MASTER_PORT from the environment (the job script's, or ``ddpkit run``'s); ``--timeout S``
bounds the group's forming (the collective timeout) either way. Prints one JSON line
``{"rank", "node", "sum"}`` once the all_reduce is done; a group that does not form ends the
rank with the error instead.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--timeout", type=float, default=20.0)
    opts = parser.parse_args()
    if opts.plain:
        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=int(os.environ.get("RANK", os.environ["SLURM_PROCID"])),
            world_size=int(os.environ.get("WORLD_SIZE", os.environ["SLURM_NTASKS"])),
            timeout=timedelta(seconds=opts.timeout),
        )
        rank = dist.get_rank()
    else:
        import ddpkit

        rank = ddpkit.init(backend="gloo", timeout_s=opts.timeout).rank
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(json.dumps({"rank": rank, "node": socket.gethostname(), "sum": int(value.item())}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
