"""The requeue rules, pure and torch-free: the cap, and which job to requeue.

``ddpkit.worker.preempt`` acts on them inside the job; the job scripts export the variable they
read (``DDPKIT_MAX_REQUEUES``); the signal's vocabulary is :mod:`ddpkit.cluster.stop.signals`.
Inputs are mappings of environment variables, so every rule is a table test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.cluster.envvars import parse_int, to_int
from ddpkit.contract import DEFAULT_MAX_REQUEUES, MAX_REQUEUES_VAR
from ddpkit.errors import ConfigError

__all__ = ["RequeuePlan", "max_requeues_from", "plan_requeue"]


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
