"""Stop on a warning signal, checkpoint, requeue, resume: ``ddpkit.preemption_guard()``.

SLURM sends a signal some time before it ends a job (``#SBATCH --signal=B:USR2@120``, which
ddpkit's templates write; ``scancel --signal=USR2`` does the same by hand)::

    guard = ddpkit.preemption_guard()      # after init(), before the loop and loader workers
    for features, labels in train:
        ...                                # one training step
        if guard.should_stop():            # a collective: True on every rank, or on none
            ddpkit.save_checkpoint(directory, state, step=step)  # or async_save_checkpoint
            guard.requeue_and_exit()       # never returns; waits for a background write

The signal handler only sets a flag; ``should_stop`` agrees on it with an ``all_reduce(MAX)``,
so every rank stops after the *same* step and none races into a collective the others never
join. ``requeue_and_exit`` has the main rank run ``scontrol requeue`` (only this task inside an
array), shares the outcome, destroys the process group and exits with code 0; the requeued job
runs the same script, which resumes from the checkpoint.

Requeues are capped: ``SLURM_RESTART_COUNT`` (how often SLURM restarted this job) must be below
``max_requeues`` (argument, else ``DDPKIT_MAX_REQUEUES``, else 10). Past the cap, outside SLURM,
or when ``scontrol`` fails, every rank exits with :data:`EXIT_STOPPED` (75, EX_TEMPFAIL: "stopped
early, run again to continue") after printing why; the checkpoint is saved either way.

Forked data loader workers inherit the handler and get the signal too: create the guard
before the loader starts its workers, or they die of the signal's default action.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import NoReturn

import torch
import torch.distributed as dist

from ddpkit.cluster.slurmtools.commands import requeue
from ddpkit.cluster.stop import latch as stopsignal
from ddpkit.cluster.stop.requeue import RequeuePlan, max_requeues_from, plan_requeue
from ddpkit.cluster.stop.signals import (
    DEFAULT_MAX_REQUEUES,
    DEFAULT_SIGNAL,
    EXIT_STOPPED,
    parse_signal,
    stop_signal,
)
from ddpkit.contract import MAX_REQUEUES_VAR, SIGNAL_VAR
from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker import inflight
from ddpkit.worker.context import current, shutdown

__all__ = [
    "DEFAULT_MAX_REQUEUES",
    "DEFAULT_SIGNAL",
    "EXIT_STOPPED",
    "MAX_REQUEUES_VAR",
    "SIGNAL_VAR",
    "PreemptionGuard",
    "RequeuePlan",
    "parse_signal",
    "plan_requeue",
    "preemption_guard",
]


def preemption_guard(
    signal_name: str | int | signal.Signals | None = None,
    *,
    max_requeues: int | None = None,
    check_every: int = 1,
    env: Mapping[str, str] | None = None,
) -> PreemptionGuard:
    """Install the stop-signal handler and return the guard (call after ``ddpkit.init()``).

    ``signal_name``: default ``DDPKIT_SIGNAL`` (set by ddpkit's job scripts), else USR2.
    ``check_every``: agree every N calls of ``should_stop`` instead of every call (each
    agreement is one tiny all_reduce). ``env``: where to read ``DDPKIT_*`` and ``SLURM_*``
    (default ``os.environ``, read once, never written).
    """
    return PreemptionGuard(signal_name, max_requeues=max_requeues, check_every=check_every, env=env)


class PreemptionGuard:
    """Turns an asynchronous signal into one agreed stop after a step; see the module doc."""

    def __init__(
        self,
        signal_name: str | int | signal.Signals | None = None,
        *,
        max_requeues: int | None = None,
        check_every: int = 1,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._env = dict(os.environ if env is None else env)
        if signal_name is None:
            chosen = stop_signal(self._env)
        else:
            chosen = parse_signal(signal_name, name="signal_name")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ConfigError(
                f"check_every={check_every!r} must be a whole number >= 1",
                hint="1 agrees after every step; 10 every tenth call of should_stop()",
            )
        self.signal = chosen
        self.max_requeues = max_requeues_from(max_requeues, self._env)
        self.check_every = check_every
        self._context = current()
        self._agreed = False
        self._calls = 0
        self._flag: torch.Tensor | None = None
        # init() may have latched it already: a signal that came before now still counts.
        if not stopsignal.latch(chosen):
            raise UsageError(
                "preemption_guard() was called outside the main thread",
                hint="create it in the main thread: only there can Python install a handler",
            )

    @property
    def received(self) -> bool:
        """True once this process got the signal (the agreement may not have happened yet)."""
        return stopsignal.received(self.signal)

    def should_stop(self) -> bool:
        """True on every rank once any rank got the signal; call it at the same points on all.

        It is a collective (every ``check_every``-th call): every rank must call it equally
        often, e.g. once per step. Once True, it stays True without further collectives.
        """
        if self._agreed:
            return True
        self._calls += 1
        if self._calls % self.check_every:
            return False
        context = self._context
        if self._flag is None:  # one tensor for every agreement: a call costs no allocation
            self._flag = torch.zeros(1, dtype=torch.int32, device=context.device)
        flag = self._flag.fill_(1 if self.received else 0)
        if context.world_size > 1 and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._agreed = bool(flag.item())
        if self._agreed and context.is_main:
            _say(f"{self.signal.name} received: every rank stops after this step")
        return self._agreed

    def requeue_and_exit(self) -> NoReturn:
        """Requeue this SLURM job from the main rank, then end every rank; never returns.

        Call it on every rank after the checkpoint is saved; a checkpoint still written in the
        background (``async_save_checkpoint``) is waited for first (bounded), and when its
        write failed every rank raises :class:`~ddpkit.errors.CheckpointError` instead. Exit
        code 0 when the job was requeued, :data:`EXIT_STOPPED` (75) otherwise, with the reason
        printed on the main rank.
        """
        context = self._context
        inflight.finish(context.world_size if dist.is_initialized() else 1)
        plan = plan_requeue(self._env, self.max_requeues)
        # Every rank ends on its own terms from here: `scontrol requeue` makes SLURM SIGTERM
        # every process of the job at once (SIGKILL still comes after KillWait), and torch's
        # agent SIGTERMs the workers that are still exiting once the first one is gone.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grouped = context.world_size > 1 and dist.is_initialized()
        if grouped:
            dist.barrier()  # everybody is past its checkpoint before the job is touched
        outcome: list[str | None] = [None]
        if context.is_main:
            if plan.target is not None:
                # said before: what is written after the requeue never reaches the job's output
                _say(f"{plan.why}: asking SLURM to put the job back in the queue; it resumes")
                _let_the_launcher_copy_output()
                outcome[0] = requeue(plan.target)
            else:
                outcome[0] = plan.why
        if grouped:
            dist.broadcast_object_list(outcome, src=0)
        failure = outcome[0]
        if context.is_main and failure is not None:
            _say(f"stopped with a checkpoint, not requeued: {failure}")
        shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(0 if failure is None else EXIT_STOPPED)


# How long the main rank waits before ``scontrol requeue`` under torch's agent, which copies
# each worker's output to the job's every 0.1 s: the requeue cancels the step at once.
COPY_GRACE_S = 2.0


def _let_the_launcher_copy_output() -> None:
    """Wait :data:`COPY_GRACE_S` under torch's agent (``TORCHELASTIC_RUN_ID`` set); a worker
    srun started itself writes to the step's output directly: no wait."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        time.sleep(COPY_GRACE_S)


def _say(message: str) -> None:
    print(f"ddpkit: {message}", file=sys.stderr, flush=True)
