"""Worker for tests/launch/test_run_identity_launch.py: one attempt of a run under ``ddpkit run``.

Joins the group, prints ``run <run id> attempt <n> origin <run id>/<attempt> of the newest
checkpoint in DIR, or none>``, saves a checkpoint in DIR (argv[1]); in attempt 0 rank 1 then
exits with code 3, so that the agent restarts the group (``--max-restarts 1``).
"""

from __future__ import annotations

import sys

import torch

import ddpkit

if __name__ == "__main__":
    folder = sys.argv[1]
    ctx = ddpkit.init(backend="gloo")
    origin = ddpkit.checkpoint_origin(folder)
    seen = "none" if origin is None else f"{origin.run_id}/{origin.attempt}"
    print(f"run {ctx.run_id} attempt {ctx.attempt} origin {seen}", flush=True)
    ddpkit.save_checkpoint(folder, {"w": torch.ones(1)}, step=ctx.attempt)
    if ctx.attempt == 0 and ctx.rank == 1:
        sys.exit(3)
