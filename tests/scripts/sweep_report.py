"""A sweep's payload for the submitit cluster test: what one run sees, as one JSON line.

As a script (``ddpkit submit --via submitit --sweep``): prints ``{"argv", "sweep", "rank",
"world_size", "launcher"}``, where ``argv`` is its arguments, ``sweep`` every ``DDPKIT_SWEEP_*``
variable and the rest the rank record ddpkit detects (torch-free: nothing to start). As a
function (``ddpkit.jobs.map_function(report, spec=spec)``, importable on the nodes as
``sweep_report.report`` with this folder on PYTHONPATH): returns the keyword values it got
and the same rank record, plus the array task SLURM says it is.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from ddpkit.cluster.detect import detect


def rank_record() -> dict[str, Any]:
    info = detect()
    return {"rank": info.rank, "world_size": info.world_size, "launcher": info.launcher}


def report(**values: str) -> dict[str, Any]:
    """What map_function calls once per run."""
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    return {"values": values, "array_task": task, **rank_record()}


def main() -> None:
    sweep = {k: v for k, v in os.environ.items() if k.startswith("DDPKIT_SWEEP_")}
    print(json.dumps({"argv": sys.argv[1:], "sweep": sweep, **rank_record()}), flush=True)


if __name__ == "__main__":
    main()
