"""SLURM job states: :class:`JobState`, the ONE table from SLURM's strings to it, and
:class:`JobStatus`, one answer about a job.

:data:`SLURM_STATES` maps long names, ``squeue``'s short codes, ``sacct``'s ``CANCELLED by 0``
and truncated ``CANCELLED+`` onto :class:`JobState`, at the edge: nothing else in ddpkit reads
SLURM's state strings.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["SLURM_STATES", "JobState", "JobStatus", "Source", "state_from_slurm"]


class JobState(enum.Enum):
    """Where a job is in its life; SLURM's many strings map onto these by :data:`SLURM_STATES`.

    PENDING -> CONFIGURING -> RUNNING -> COMPLETING -> one finished state (COMPLETED, FAILED,
    CANCELLED, TIMEOUT, PREEMPTED, NODE_FAIL, OUT_OF_MEMORY, BOOT_FAIL, DEADLINE). RUNNING can go
    to SUSPENDED and back; a requeued job goes through REQUEUED back to PENDING. COMPLETING is not
    finished: processes of the job may still be exiting. UNKNOWN: no tool knows the job (or SLURM
    printed a state this table lacks) - also not finished.
    """

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    REQUEUED = "REQUEUED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    SUSPENDED = "SUSPENDED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    UNKNOWN = "UNKNOWN"

    @property
    def is_finished(self) -> bool:
        """True once the job has ended for good and none of its processes is left."""
        return self in _FINISHED


_S = JobState
_FINISHED = frozenset({
    _S.COMPLETED, _S.FAILED, _S.CANCELLED, _S.TIMEOUT, _S.PREEMPTED, _S.NODE_FAIL,
    _S.OUT_OF_MEMORY, _S.BOOT_FAIL, _S.DEADLINE,
})  # fmt: skip
# SLURM 22.05+ state names (squeue %T, sacct State, scontrol JobState) and squeue's %t codes.
SLURM_STATES: Mapping[str, JobState] = {
    **{state.value: state for state in JobState if state is not JobState.UNKNOWN},
    "REQUEUE_HOLD": _S.REQUEUED,  # requeued and held until released
    "REQUEUE_FED": _S.REQUEUED,
    "SPECIAL_EXIT": _S.REQUEUED,  # requeued (held) after a site-chosen exit code
    "RESV_DEL_HOLD": _S.PENDING,  # held because its reservation was deleted
    "RESIZING": _S.RUNNING,
    "SIGNALING": _S.RUNNING,
    "STAGE_OUT": _S.COMPLETING,  # burst buffer stage-out after the processes ended
    "STOPPED": _S.SUSPENDED,  # SIGSTOPped, keeps its resources
    "REVOKED": _S.CANCELLED,  # federation: a sibling job started elsewhere
    "PD": _S.PENDING, "CF": _S.CONFIGURING, "R": _S.RUNNING, "CG": _S.COMPLETING,
    "CD": _S.COMPLETED, "F": _S.FAILED, "CA": _S.CANCELLED, "TO": _S.TIMEOUT,
    "PR": _S.PREEMPTED, "RQ": _S.REQUEUED, "NF": _S.NODE_FAIL, "OOM": _S.OUT_OF_MEMORY,
    "S": _S.SUSPENDED, "BF": _S.BOOT_FAIL, "DL": _S.DEADLINE, "RH": _S.REQUEUED,
    "RF": _S.REQUEUED, "SE": _S.REQUEUED, "RD": _S.PENDING, "RS": _S.RUNNING,
    "SI": _S.RUNNING, "SO": _S.COMPLETING, "ST": _S.SUSPENDED, "RV": _S.CANCELLED,
}  # fmt: skip
_LONG_NAMES = sorted(name for name in SLURM_STATES if len(name) > 3)


def state_from_slurm(raw: str) -> JobState:
    """Map any state string SLURM prints to a :class:`JobState`; unknown strings give UNKNOWN.

    ``sacct`` appends who cancelled (``CANCELLED by 0``) and, in fixed-width output, truncates
    with ``+`` (``CANCELLED+``, ``OUT_OF_ME+``): both are understood.
    """
    text = re.sub(r"\s+BY\s+\S+$", "", raw.strip().upper())
    if text in SLURM_STATES:
        return SLURM_STATES[text]
    if text.endswith("+"):
        states = {SLURM_STATES[name] for name in _LONG_NAMES if name.startswith(text[:-1])}
        if len(states) == 1:
            return states.pop()
    return JobState.UNKNOWN


Source = Literal["squeue", "sacct", "scontrol", "torchx", "none"]


@dataclass(frozen=True)
class JobStatus:
    """One answer about a job: the mapped state, SLURM's own string, and who said so.

    ``exit_code``/``signal`` come from ``sacct``/``scontrol`` (``ExitCode=3:0``); ``squeue`` has
    none. ``hint`` explains an UNKNOWN state.
    """

    state: JobState
    raw: str
    exit_code: int | None
    source: Source
    signal: int | None = None
    hint: str | None = None
