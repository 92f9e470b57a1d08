"""The run's identity: one id shared by every rank and every attempt of a run, and the attempt.

A run is what a user thinks of as one training: SLURM may requeue it (``SLURM_RESTART_COUNT``
counts the requeues) and ``ddpkit run --max-restarts`` restart it (``TORCHELASTIC_RESTART_COUNT``).
Every attempt carries the same id, so that checkpoints, job records and a tracker (a W&B run
resumed instead of a new one per attempt) tie them together. The id, first that applies:

1. ``DDPKIT_RUN_ID``, set by the user, checked by :func:`check_run_id`; ``ddpkit run`` also
   sets it for its workers, from the steps below, so they never need step 4.
2. A SLURM job: ``slurm-<job id>``, or ``slurm-<array job id>_<task id>`` in a job array; a
   requeue keeps both.
3. Torch's agent (``ddpkit run``, ``torchrun``): its rendezvous id ``TORCHELASTIC_RUN_ID``,
   unless it is torch's placeholder ``none`` or no usable id by step 1's rule.
4. Nothing names the run (a world of one started by hand, ``env://`` variables, MPI): a fresh
   id (``run-`` and 12 hex digits); :func:`ddpkit.init` has every rank agree on rank 0's.

The attempt counts from 0: ``requeues * (max_restarts + 1) + restarts`` (each counter 0 when
unset). Under ``ddpkit run`` inside a requeued SLURM job it goes on increasing and never
repeats: each requeue starts a block of ``max_restarts + 1`` numbers. Torch's agents keep their
restart counts equal on every node, so every rank reads the same attempt.

Pure: reads a snapshot of the environment, never writes it; only the fresh id is random.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from ddpkit.cluster.envvars import env_int
from ddpkit.contract import RUN_ID_MAX_CHARS, RUN_ID_VAR
from ddpkit.errors import ConfigError

__all__ = [
    "RunIdentity",
    "RunSource",
    "check_run_id",
    "fresh_run_id",
    "launch_run_id",
    "run_identity",
]

RunSource = Literal["user", "slurm", "agent", "fresh"]
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_AGENT_RUN_ID = "TORCHELASTIC_RUN_ID"
_AGENT_PLACEHOLDER = "none"  # torch's --rdzv-id default: names no run
_COUNTERS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


@dataclass(frozen=True)
class RunIdentity:
    """The run this process belongs to: ``run_id``, the ``attempt`` (0 first), how many SLURM
    requeues and agent restarts came before it, and where the id came from (``source``)."""

    run_id: str
    attempt: int
    requeues: int = 0
    restarts: int = 0
    source: RunSource = "user"


def check_run_id(value: str, name: str = RUN_ID_VAR) -> str:
    """``value`` when it is a usable run id, else a ConfigError naming ``name`` and the value."""
    if len(value) <= RUN_ID_MAX_CHARS and _SAFE.fullmatch(value):
        return value
    raise ConfigError(
        f"{name}={value[: RUN_ID_MAX_CHARS + 8]!r} is not a usable run id",
        hint=f"use at most {RUN_ID_MAX_CHARS} letters, digits, '.', '_' or '-', starting with "
        "a letter or digit (e.g. bert-large-3), or unset it to get the SLURM job's",
    )


def fresh_run_id() -> str:
    """A new id for a run that nothing else names."""
    return f"run-{secrets.token_hex(6)}"


def named_run_id(env: Mapping[str, str]) -> tuple[str, RunSource] | None:
    """The run id steps 1-3 give (see the module), with its source; None when none applies."""
    if env.get(RUN_ID_VAR, ""):
        return check_run_id(env[RUN_ID_VAR]), "user"
    slurm = _slurm_run_id(env)
    if slurm is not None:
        return slurm, "slurm"
    agent = env.get(_AGENT_RUN_ID, "")
    # torch takes any --rdzv-id; one that is no usable run id is passed over, not an error
    if agent != _AGENT_PLACEHOLDER and len(agent) <= RUN_ID_MAX_CHARS and _SAFE.fullmatch(agent):
        return agent, "agent"
    return None


def _slurm_run_id(env: Mapping[str, str]) -> str | None:
    hint = "the variables SLURM sets for a job; unset them outside one"
    array, task = env_int(env, "SLURM_ARRAY_JOB_ID", hint=hint), env.get("SLURM_ARRAY_TASK_ID")
    if array is not None and task is not None:
        return f"slurm-{array}_{env_int(env, 'SLURM_ARRAY_TASK_ID', hint=hint)}"
    job = env_int(env, "SLURM_JOB_ID", hint=hint)
    return None if job is None else f"slurm-{job}"


def run_identity(env: Mapping[str, str], *, fresh: Callable[[], str] = fresh_run_id) -> RunIdentity:
    """The run id and attempt ``env`` gives (see the module); ``fresh`` makes step 4's id."""
    hint = "a count of attempts, set by SLURM or torch's agent: a whole number >= 0"
    requeues, restarts, max_restarts = (
        max(0, env_int(env, name, hint=hint) or 0) for name in _COUNTERS
    )
    attempt = requeues * (max(max_restarts, restarts) + 1) + restarts
    named = named_run_id(env)
    run_id, source = named if named is not None else (fresh(), "fresh")
    return RunIdentity(run_id, attempt, requeues, restarts, source)


def launch_run_id(env: Mapping[str, str], rdzv_id: str, *, one_node: bool) -> str | None:
    """The ``DDPKIT_RUN_ID`` ``ddpkit run`` hands its workers: steps 1-3 with its own
    rendezvous id; a fresh id for a one-node launch with none; None when several nodes
    launch without ``--rdzv-id`` (their launchers could not agree on a fresh one: the
    workers then agree on one per attempt, see :func:`ddpkit.init`)."""
    named = named_run_id({**env, _AGENT_RUN_ID: rdzv_id})
    if named is not None:
        return named[0]
    return fresh_run_id() if one_node else None
