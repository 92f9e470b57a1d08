"""SLURM requeue arithmetic, pure and torch-free: the stop signal, the cap, the job to requeue.

``ddpkit.worker.preempt`` acts on it inside the job; the job renderer exports the variables it reads
(``DDPKIT_SIGNAL``, ``DDPKIT_MAX_REQUEUES``). Inputs are mappings of environment variables, so
every rule is a table test.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.cluster.envvars import number_hint, parse_int, to_int
from ddpkit.contract import MAX_REQUEUES_VAR, SIGNAL_VAR
from ddpkit.errors import ConfigError

__all__ = [
    "ALLOWED_SIGNALS",
    "DEFAULT_MAX_REQUEUES",
    "DEFAULT_SIGNAL",
    "EXIT_STOPPED",
    "RequeuePlan",
    "max_requeues_from",
    "parse_signal",
    "plan_requeue",
    "signal_from_env",
]

DEFAULT_SIGNAL = "USR2"  # NCCL and some MPI stacks use USR1 for themselves
DEFAULT_MAX_REQUEUES = 10
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped with a checkpoint, not requeued; run again to resume
ALLOWED_SIGNALS = ("USR1", "USR2", "HUP", "INT", "TERM", "URG", "XCPU")


def parse_signal(value: str | int | signal.Signals, *, name: str = SIGNAL_VAR) -> signal.Signals:
    """``"USR2"``, ``"SIGUSR2"``, ``12`` or ``signal.SIGUSR2`` -> ``signal.SIGUSR2``."""
    if isinstance(value, signal.Signals):
        return value
    text = str(value).strip().upper()
    number = to_int(text)
    if number is not None:
        try:
            found = signal.Signals(number)
        except ValueError:
            found = None
    else:
        found = getattr(signal, text if text.startswith("SIG") else f"SIG{text}", None)
    if not isinstance(found, signal.Signals) or found.name[3:] not in ALLOWED_SIGNALS:
        raise ConfigError(
            f"{name}={value!r} is not a signal ddpkit can stop on",
            hint=number_hint(text, f"one of {', '.join(ALLOWED_SIGNALS)} (USR2 is the default)"),
        )
    return found


def max_requeues_from(value: int | None, env: Mapping[str, str]) -> int:
    """``value`` if given, else ``DDPKIT_MAX_REQUEUES`` from ``env``, else the default (10)."""
    if value is None:
        text = env.get(MAX_REQUEUES_VAR, "").strip()
        if not text:
            return DEFAULT_MAX_REQUEUES
        hint = f"e.g. {MAX_REQUEUES_VAR}=10 (0: never requeue)"
        count = parse_int(MAX_REQUEUES_VAR, text, hint=hint)
        if count < 0:
            raise ConfigError(f"{MAX_REQUEUES_VAR}={text!r} is not a whole number >= 0", hint=hint)
        return count
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"max_requeues={value!r} is not a whole number >= 0", hint="e.g. max_requeues=10"
        )
    return value


@dataclass(frozen=True)
class RequeuePlan:
    """What a stopped job does next: ``target`` is the scontrol job id, or None with ``why``."""

    target: str | None
    why: str
    restarts: int


def plan_requeue(env: Mapping[str, str], max_requeues: int) -> RequeuePlan:
    """Whether and what to requeue, from the job's variables (pure)."""
    job = env.get("SLURM_JOB_ID", "").strip()
    count_text = env.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    restarts = max(to_int(count_text) or 0, 0)  # SLURM's own counter: unreadable counts as 0
    if not job:
        return RequeuePlan(None, "not a SLURM job (no SLURM_JOB_ID): nothing to requeue", 0)
    if restarts >= max_requeues:
        return RequeuePlan(
            None,
            f"requeue cap reached (SLURM_RESTART_COUNT={restarts}, max {max_requeues}; "
            f"raise {MAX_REQUEUES_VAR} or max_requeues in the job spec)",
            restarts,
        )
    array_job = env.get("SLURM_ARRAY_JOB_ID", "").strip()
    array_task = env.get("SLURM_ARRAY_TASK_ID", "").strip()
    # An array task has its own SLURM_JOB_ID, but the last task's is the array's id itself:
    # only "<array>_<task>" names one task for certain.
    target = f"{array_job}_{array_task}" if array_job and array_task else job
    return RequeuePlan(target, f"requeue {target} ({restarts + 1} of {max_requeues})", restarts)


def signal_from_env(env: Mapping[str, str]) -> signal.Signals:
    """The stop signal ``DDPKIT_SIGNAL`` names in ``env``, else the default (USR2)."""
    return parse_signal(env.get(SIGNAL_VAR, "").strip() or DEFAULT_SIGNAL)
