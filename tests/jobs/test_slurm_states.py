"""SLURM state strings -> JobState (the one table), is_finished, job id parsing: pure tables."""

from __future__ import annotations

import pytest

from ddpkit.cluster.slurmtools import SLURM_STATES, JobState, parse_job_id, state_from_slurm
from ddpkit.errors import ConfigError

S = JobState

# Every string SLURM 22.05+ prints for a job's state (squeue %T / sacct State / scontrol JobState)
# and squeue's %t short codes, with what ddpkit makes of it.
RAW_STATES: dict[str, JobState] = {
    "PENDING": S.PENDING, "CONFIGURING": S.CONFIGURING, "RUNNING": S.RUNNING,
    "COMPLETING": S.COMPLETING, "COMPLETED": S.COMPLETED, "FAILED": S.FAILED,
    "CANCELLED": S.CANCELLED, "TIMEOUT": S.TIMEOUT, "PREEMPTED": S.PREEMPTED,
    "REQUEUED": S.REQUEUED, "NODE_FAIL": S.NODE_FAIL, "OUT_OF_MEMORY": S.OUT_OF_MEMORY,
    "SUSPENDED": S.SUSPENDED, "BOOT_FAIL": S.BOOT_FAIL, "DEADLINE": S.DEADLINE,
    "REQUEUE_HOLD": S.REQUEUED, "REQUEUE_FED": S.REQUEUED, "SPECIAL_EXIT": S.REQUEUED,
    "RESV_DEL_HOLD": S.PENDING, "RESIZING": S.RUNNING, "SIGNALING": S.RUNNING,
    "STAGE_OUT": S.COMPLETING, "STOPPED": S.SUSPENDED, "REVOKED": S.CANCELLED,
    "PD": S.PENDING, "CF": S.CONFIGURING, "R": S.RUNNING, "CG": S.COMPLETING,
    "CD": S.COMPLETED, "F": S.FAILED, "CA": S.CANCELLED, "TO": S.TIMEOUT, "PR": S.PREEMPTED,
    "RQ": S.REQUEUED, "NF": S.NODE_FAIL, "OOM": S.OUT_OF_MEMORY, "S": S.SUSPENDED,
    "BF": S.BOOT_FAIL, "DL": S.DEADLINE, "RH": S.REQUEUED, "RF": S.REQUEUED, "SE": S.REQUEUED,
    "RD": S.PENDING, "RS": S.RUNNING, "SI": S.RUNNING, "SO": S.COMPLETING, "ST": S.SUSPENDED,
    "RV": S.CANCELLED,
}  # fmt: skip

# What sacct and hand-typed input add around those strings.
DECORATED: dict[str, JobState] = {
    "CANCELLED by 0": S.CANCELLED,  # sacct -P names who cancelled
    "CANCELLED by 1234": S.CANCELLED,
    "CANCELLED+": S.CANCELLED,  # sacct's fixed-width columns truncate with +
    "OUT_OF_ME+": S.OUT_OF_MEMORY,
    "NODE_FAIL+": S.NODE_FAIL,
    "REQUEUE+": S.REQUEUED,  # several names, one state
    " running\n": S.RUNNING,
    "cancelled by 0": S.CANCELLED,
    "cd": S.COMPLETED,
}

# Strings no table entry matches: UNKNOWN, never an exception (torchx crashes on these).
UNMAPPED = ["", "UNKNOWN", "BOGUS", "RE+", "+", "CANCELLED by", "RUNNING!", "by 0", "P"]

FINISHED = {
    S.COMPLETED, S.FAILED, S.CANCELLED, S.TIMEOUT, S.PREEMPTED, S.NODE_FAIL, S.OUT_OF_MEMORY,
    S.BOOT_FAIL, S.DEADLINE,
}  # fmt: skip


def test_the_test_table_covers_every_entry_of_the_module_table() -> None:
    assert dict(SLURM_STATES) == RAW_STATES


@pytest.mark.parametrize(("raw", "state"), sorted({**RAW_STATES, **DECORATED}.items()))
def test_state_from_slurm(raw: str, state: JobState) -> None:
    assert state_from_slurm(raw) is state


@pytest.mark.parametrize("raw", UNMAPPED)
def test_unmapped_strings_are_unknown(raw: str) -> None:
    assert state_from_slurm(raw) is JobState.UNKNOWN


@pytest.mark.parametrize("state", list(JobState))
def test_is_finished(state: JobState) -> None:
    assert state.is_finished is (state in FINISHED)


def test_every_state_but_unknown_has_its_own_name_in_the_table() -> None:
    assert {state for state in JobState if SLURM_STATES.get(state.value) is state} == set(
        JobState
    ) - {JobState.UNKNOWN}


@pytest.mark.parametrize(
    ("given", "expected"),
    [("123", "123"), (123, "123"), (" 42\n", "42"), ("123_4", "123_4"), ("123+0", "123+0")],
)
def test_parse_job_id(given: str | int, expected: str) -> None:
    assert parse_job_id(given) == expected


@pytest.mark.parametrize(
    "given", ["", "abc", "123_", "_4", "12_3_4", "123.batch", "-1", "1 2", "123_[1-3]", "1+2_3"]
)
def test_parse_job_id_rejects(given: str) -> None:
    with pytest.raises(ConfigError, match=r"job_id=.* is not a SLURM job id") as caught:
        parse_job_id(given)
    assert caught.value.hint is not None
    assert "123_4" in caught.value.hint
