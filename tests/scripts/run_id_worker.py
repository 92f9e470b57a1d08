"""Worker for tests/launch/test_run_identity_launch.py: one attempt of a run under ``ddpkit run``.

Prints ``run <run id> attempt <n>`` as its environment names them
(:func:`ddpkit.cluster.runid.run_identity`: what ``ddpkit.init`` reads from the launcher's
variables before it joins a group; torch-free). Rank 0 then prints ``origin <run id>/<attempt>
of the newest checkpoint in DIR (argv[1]), or none>`` and saves a real checkpoint there
(``ddpkit.save_checkpoint`` without a process group: stamped with that same identity); in
attempt 0 rank 1 exits with code 3 once that checkpoint exists, so that the agent restarts the
group (``--max-restarts 1``). Only rank 0 imports torch: a launch of 2 ranks, 2 attempts, costs
2 torch imports, not 4 (nor their gloo group, which the identity does not need).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ddpkit.cluster.runid import run_identity

if __name__ == "__main__":
    folder = Path(sys.argv[1])
    run = run_identity(os.environ)
    rank = int(os.environ["RANK"])
    print(f"run {run.run_id} attempt {run.attempt}", flush=True)
    if rank == 0:
        import torch

        import ddpkit

        origin = ddpkit.checkpoint_origin(folder)
        seen = "none" if origin is None else f"{origin.run_id}/{origin.attempt}"
        print(f"origin {seen}", flush=True)
        ddpkit.save_checkpoint(folder, {"w": torch.ones(1)}, step=run.attempt)
    elif run.attempt == 0:
        deadline = time.monotonic() + 120  # rank 0 imports torch first
        while not list(folder.glob("ckpt-*.pt")) and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(3)
