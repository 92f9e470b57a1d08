"""Torch-free payload of tests/jobs/test_sweep_cluster.py: one sweep task's run, which stops,
requeues and resumes through ddpkit's torch-free stop path, without training.

What the sweep test judges is plumbing: each array task gets its own values and folders, a stop
signal to one task requeues that task alone, a cancel ends one task. None of it needs torch, so
no process here imports it (an ``import torch`` costs ~2 CPU-seconds a rank on the test machine).
Training that resumes exactly after a requeue is tests/launch/test_preempt_cluster.py's, with
examples/train.py.

The stop path is ddpkit's own, as ``ddpkit.init()`` and the preemption guard take it: the job
contract's signal is latched (:func:`ddpkit.cluster.stop.latch.latch_from_env`, the marker in
the job's latch folder included), the rank comes from :func:`ddpkit.cluster.detect.detect`,
and on the signal rank 0 requeues with :func:`~ddpkit.cluster.stop.requeue.plan_requeue`'s
target (an array task's ``<array>_<task>``) through ``scontrol requeue``
(:func:`ddpkit.cluster.slurmtools.commands.requeue`). The "checkpoint" is a text file holding
its step; a run that finds one resumes after it.

Prints what examples/train.py prints for the same events (``hyperparameters: lr ..``,
``resumed from DIR at step N ..``, ``stop signal: saved step N ..``, ``requeue ..: done``)
and, at its end, ``result: lr LR seed SEED after N steps``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from ddpkit.cluster.detect import detect
from ddpkit.cluster.slurmtools.commands import requeue
from ddpkit.cluster.stop import latch
from ddpkit.cluster.stop.requeue import max_requeues_from, plan_requeue


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--step-delay", type=float, default=0.5)
    args = parser.parse_args()
    sig = latch.latch_from_env(os.environ)  # first, as ddpkit.init() does
    info = detect()
    print(f"rank {info.rank}: {info.launcher}, world size {info.world_size}", flush=True)
    say = print if info.rank == 0 else (lambda *_, **__: None)
    say(f"hyperparameters: lr {args.lr}, seed {args.seed}", flush=True)
    step = _resume(args.checkpoint_dir)
    if step:
        say(f"resumed from {args.checkpoint_dir} at step {step} (of {args.steps})", flush=True)
    while step < args.steps:
        time.sleep(args.step_delay)
        step += 1
        if sig is not None and latch.received(sig):
            _stop(args.checkpoint_dir, step, info.rank)
        if step % args.checkpoint_every == 0 and info.rank == 0:
            _save(args.checkpoint_dir, step)
    say(f"result: lr {args.lr} seed {args.seed} after {step} steps", flush=True)


def _resume(directory: Path) -> int:
    steps = [int(path.read_text()) for path in directory.glob("ckpt-*.pt")]
    return max(steps, default=0)


def _save(directory: Path, step: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".ckpt-{step}.tmp"
    partial.write_text(str(step))
    partial.replace(directory / f"ckpt-{step}.pt")  # whole or absent, as ddpkit's are


def _stop(directory: Path, step: int, rank: int) -> None:
    """What the preemption guard does after the agreed step: save, requeue from rank 0, end."""
    # `scontrol requeue` makes SLURM TERM every process of the job: finish first
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 0:
        _save(directory, step)
        print(f"stop signal: saved step {step} in {directory}", file=sys.stderr, flush=True)
        plan = plan_requeue(os.environ, max_requeues_from(None, os.environ))
        failure = requeue(plan.target) if plan.target is not None else plan.why
        print(f"ddpkit: {plan.why}: {failure or 'done'}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
