"""Torch-free payload of tests/launch/test_preempt_cluster.py: a run that stops on the job
contract's signal after a step every rank agrees on, requeues its job and resumes exactly after
that step, without training.

What most of the preemption scenarios judge is plumbing: SLURM's warning or a hand-sent signal
reaches every rank, or is held by the batch shell or the task's wrapper until every process has
latched it, and the job is requeued and resumes from its checkpoint. None of it needs torch, so
no process here imports it (an ``import torch`` costs ~2 CPU-seconds a rank on the test
machine, a DDP rank twice that). That the weights come out bitwise identical after a requeue is
the test's one examples/train.py job.

The stop path is ddpkit's own torch-free part, as ``ddpkit.init()`` and the preemption guard
take it: the signal is latched first (:func:`ddpkit.cluster.stop.latch.latch_from_env`, the
marker in the job's latch folder included), the rank comes from
:func:`ddpkit.cluster.detect.detect`, and rank 0 requeues with
:func:`~ddpkit.cluster.stop.requeue.plan_requeue`'s target through ``scontrol requeue``
(:func:`ddpkit.cluster.slurmtools.commands.requeue`). The guard's ``all_reduce(MAX)`` is a file
per rank and step here (``<ckpt>/agree-<restart>/<step>.<rank>``: 1 when the rank got the
signal): every rank stops after the same step. The "checkpoint" is a text file of its step.

Usage: ``preempt_stop.py --checkpoint-dir DIR [--steps N] [--checkpoint-every K]
[--step-delay S]``. Prints what examples/train.py and the guard print for the same events
(``resumed from DIR at step N``, ``ddpkit: SIGUSR2 received: every rank stops after this step``,
``stop signal: saved step N in DIR``, ``ddpkit: requeue ... asking SLURM to put the job back``),
appends each step it completes to ``DIR/steps-<rank>.txt`` and at its end prints
``result: every rank ran N steps``.
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

AGREE_TIMEOUT_S = 120.0  # a peer that never reaches the step: the job fails, it does not hang


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--step-delay", type=float, default=0.1)
    args = parser.parse_args()
    sig = latch.latch_from_env(os.environ)  # first, as ddpkit.init() does
    info = detect()
    directory: Path = args.checkpoint_dir
    directory.mkdir(parents=True, exist_ok=True)
    agree = directory / f"agree-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    agree.mkdir(exist_ok=True)
    step = max((int(p.read_text()) for p in directory.glob("ckpt-*.pt")), default=0)
    if step and info.rank == 0:
        print(f"resumed from {directory} at step {step} (of {args.steps})", flush=True)
    while step < args.steps:
        time.sleep(args.step_delay)
        step += 1
        with (directory / f"steps-{info.rank}.txt").open("a") as done:
            done.write(f"{step}\n")
        got = sig is not None and latch.received(sig)
        if _agree(agree, step, info.rank, info.world_size, got):
            assert sig is not None
            _stop(directory, step, info.rank, sig)
        if step % args.checkpoint_every == 0 and info.rank == 0:
            _save(directory, step)
    if info.rank == 0:
        print(f"result: every rank ran {step} steps", flush=True)


def _agree(folder: Path, step: int, rank: int, world: int, got: bool) -> bool:
    """True on every rank when any rank got the signal by ``step`` (the guard's all_reduce)."""
    mine = folder / f"{step}.{rank}"
    partial = folder / f".{step}.{rank}.tmp"
    partial.write_text("1" if got else "0")
    partial.replace(mine)  # whole or absent
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    while True:
        votes = [folder / f"{step}.{peer}" for peer in range(world)]
        if all(v.exists() for v in votes):
            return any(v.read_text() == "1" for v in votes)
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: no agreement on step {step} within {AGREE_TIMEOUT_S} s")
        time.sleep(0.01)


def _save(directory: Path, step: int) -> None:
    partial = directory / f".ckpt-{step}.tmp"
    partial.write_text(str(step))
    partial.replace(directory / f"ckpt-{step}.pt")  # whole or absent, as ddpkit's are


def _stop(directory: Path, step: int, rank: int, sig: signal.Signals) -> None:
    """What train.py and the guard do after the agreed step: save, requeue from rank 0, end."""
    # `scontrol requeue` makes SLURM TERM every process of the job: finish first
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 0:
        print(f"ddpkit: {sig.name} received: every rank stops after this step", file=sys.stderr)
        _save(directory, step)
        print(f"stop signal: saved step {step} in {directory}", file=sys.stderr, flush=True)
        plan = plan_requeue(os.environ, max_requeues_from(None, os.environ))
        if plan.target is None:
            sys.exit(f"ddpkit: stopped with a checkpoint, not requeued: {plan.why}")
        print(f"ddpkit: {plan.why}: asking SLURM to put the job back in the queue; it resumes",
              file=sys.stderr, flush=True)  # fmt: skip
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            time.sleep(2.0)  # the guard's grace: torch's agent copies the output every 0.1 s
        failure = requeue(plan.target)
        if failure is not None:
            sys.exit(f"ddpkit: stopped with a checkpoint, not requeued: {failure}")
    sys.exit(0)


if __name__ == "__main__":
    main()
