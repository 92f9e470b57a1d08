"""Worker for tests/launch/test_run_identity_cluster.py: prints its run id and attempt, and in
attempt 0 requeues its own SLURM job through ddpkit's preemption guard."""

from __future__ import annotations

import ddpkit

if __name__ == "__main__":
    ctx = ddpkit.init(backend="gloo")
    guard = ddpkit.preemption_guard()
    print(f"rank {ctx.rank} run {ctx.run_id} attempt {ctx.attempt}", flush=True)
    if ctx.attempt == 0:
        guard.requeue_and_exit()
