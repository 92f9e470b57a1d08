"""Asking SLURM about a job: squeue (live) -> sacct (accounting) -> scontrol -> UNKNOWN.

This module owns job ids (:func:`parse_job_id`: ``123``, array tasks ``123_4``, heterogeneous
components ``123+0``), one parser per tool's output (``squeue``'s ``%i|%T``, ``sacct
--parsable2``, ``scontrol --oneliner``'s ``Key=value`` pairs: :func:`scontrol_fields`), and
:func:`query_state`'s order. Every command goes through a :class:`~.runner.Runner`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from ddpkit.cluster.envvars import number_hint
from ddpkit.cluster.slurmtools.runner import (
    Runner,
    SlurmError,
    first_line,
    lines,
    subprocess_runner,
)
from ddpkit.cluster.slurmtools.states import JobState, JobStatus, Source, state_from_slurm
from ddpkit.errors import ConfigError

__all__ = [
    "NOT_FOUND",
    "Row",
    "covers",
    "is_job_id",
    "job_fields",
    "job_restarts",
    "parse_job_id",
    "query_state",
    "row_status",
    "scontrol_fields",
    "tool_rows",
]

_S = JobState
# [0-9], not \d: \d takes every script's digits ("٣"), which SLURM would not know.
_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+|\+[0-9]+)?")


def parse_job_id(job_id: str | int) -> str:
    """Validate a job id (``123``, array task ``123_4``, heterogeneous component ``123+0``)."""
    text = str(job_id).strip()
    if not _JOB_ID.fullmatch(text):
        raise ConfigError(
            f"job_id={job_id!r} is not a SLURM job id",
            hint=number_hint(
                text, "a number like 123, an array task like 123_4 or a component like 123+0"
            ),
        )
    return text


def is_job_id(text: str) -> bool:
    """Whether ``text`` is a job id as SLURM prints it (``123``, ``123_4``, ``123+0``)."""
    return _JOB_ID.fullmatch(text) is not None


class Row(NamedTuple):
    job_id: str  # as the tool prints it: 123, 123_4, 123_[5-10], 123+0
    raw: str
    exit_code: int | None
    signal: int | None
    restarts: int | None = None  # scontrol's Restarts= (the requeue count); other tools: None


def _exit_code(text: str) -> tuple[int | None, int | None]:
    code, _, sig = text.partition(":")
    if code.isdigit() and sig.isdigit():
        return int(code), int(sig)
    return None, None


def covers(shown: str, job_id: str) -> bool:
    """Whether a pending-array row like ``123_[5-10:2,12%4]`` stands for the task ``job_id``."""
    base, _, task = job_id.partition("_")
    match = re.fullmatch(re.escape(base) + r"_\[([0-9,:\-]+)(?:%\d+)?\]", shown)
    if not task or match is None:
        return False
    number = int(task)
    for part in match.group(1).split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?(?::(\d+))?", part)
        if bounds is not None:
            low, step = int(bounds.group(1)), max(int(bounds.group(3) or 1), 1)
            if low <= number <= int(bounds.group(2) or low) and (number - low) % step == 0:
                return True
    return False


def _select(rows: Sequence[Row], job_id: str) -> Row | None:
    """The row answering for ``job_id``: its own, else (for a plain id) the most telling part.

    A live array task or het component means the job is not over (the most advanced live one
    is reported); once all are finished, the first that did not complete is, so a failure shows.
    """
    own = [row for row in rows if row.job_id == job_id or covers(row.job_id, job_id)]
    if own or not job_id.isdigit():
        return own[0] if own else None
    parts = [row for row in rows if re.split(r"[_+]", row.job_id)[0] == job_id]
    if not parts:  # asked by the raw id of one array task, the tool shows it as 123_4
        return rows[0] if len(rows) == 1 else None
    live = [row for row in parts if not state_from_slurm(row.raw).is_finished]
    if live:  # squeue lists pending tasks first; one running task means the job runs
        return min(live, key=lambda row: _LIVE_RANK.get(state_from_slurm(row.raw), 9))
    failed = [row for row in parts if state_from_slurm(row.raw) is not JobState.COMPLETED]
    return (failed or parts)[0]


_LIVE = [_S.RUNNING, _S.COMPLETING, _S.CONFIGURING, _S.SUSPENDED, _S.REQUEUED, _S.PENDING]
_LIVE_RANK = {state: rank for rank, state in enumerate(_LIVE)}


NOT_FOUND = ("Invalid job id specified",)


def _squeue_rows(stdout: str) -> list[Row]:
    return [Row(*line.partition("|")[::2], None, None) for line in lines(stdout)]


def _sacct_rows(stdout: str) -> list[Row]:
    fields = [line.split("|") for line in lines(stdout)]
    return [Row(row[0], row[1], *_exit_code(row[2])) for row in fields if len(row) == 3]


_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")


def scontrol_fields(line: str) -> dict[str, str]:
    """``Key=value`` pairs of one ``scontrol --oneliner`` line (values may hold spaces)."""
    keys = list(_SCONTROL_KEY.finditer(line))
    ends = [match.start() for match in keys[1:]] + [len(line)]
    pairs = zip(keys, ends, strict=True)
    return {key.group(1): line[key.end() : end].strip() for key, end in pairs}


def _scontrol_row(line: str) -> Row:
    """The row of one ``scontrol show job --oneliner`` line."""
    fields = scontrol_fields(line)
    job_id = fields.get("JobId", "")
    task = fields.get("ArrayTaskId", "N/A")
    if task != "N/A" and "ArrayJobId" in fields:
        job_id = f"{fields['ArrayJobId']}_{task if task.isdigit() else f'[{task}]'}"
    elif "HetJobOffset" in fields and "HetJobId" in fields:
        job_id = f"{fields['HetJobId']}+{fields['HetJobOffset']}"
    restarts = fields.get("Restarts", "")
    return Row(
        job_id,
        fields.get("JobState", ""),
        *_exit_code(fields.get("ExitCode", "")),
        int(restarts) if restarts.isdigit() else None,
    )


# per tool: the command (the job id is appended), its output parser, what "no row" means
_TOOLS: dict[Source, tuple[list[str], Callable[[str], list[Row]], str]] = {
    "squeue": (
        ["squeue", "--noheader", "--array", "--format", "%i|%T", "--jobs"],
        _squeue_rows,
        "not listed",
    ),
    "sacct": (
        ["sacct", "--allocations", "--noheader", "--parsable2", "-oJobID,State,ExitCode", "-j"],
        _sacct_rows,
        "no record",
    ),
    "scontrol": (
        ["scontrol", "show", "job", "--oneliner"],
        lambda stdout: [_scontrol_row(line) for line in lines(stdout)],
        "forgotten or never known",
    ),
}


def tool_rows(
    source: Source, job_id: str, runner: Runner, env: Mapping[str, str] | None
) -> tuple[list[Row], str]:
    """One tool's rows about the job (and its array tasks), or none and why."""
    argv, parse, no_row = _TOOLS[source]
    done = runner([*argv, job_id], env=env)
    if done.returncode != 0:
        not_found = any(text in done.stderr for text in NOT_FOUND)
        return [], no_row if not_found else f"failed: {first_line(done.stderr)}"
    return parse(done.stdout), no_row


def row_status(row: Row, source: Source) -> JobStatus:
    return JobStatus(state_from_slurm(row.raw), row.raw, row.exit_code, source, row.signal)


def _ask(
    source: Source, job_id: str, runner: Runner, env: Mapping[str, str] | None
) -> tuple[JobStatus | None, str]:
    """One tool's status of the job, or None and why it has none."""
    rows, no_row = tool_rows(source, job_id, runner, env)
    if not rows:
        return None, no_row
    row = _select(rows, job_id)
    if row is None:
        return None, no_row
    return row_status(row, source), ""


def query_state(
    job_id: str | int, *, runner: Runner = subprocess_runner, env: Mapping[str, str] | None = None
) -> JobStatus:
    """The state of ``job_id``: squeue (live) -> sacct (accounting) -> scontrol -> UNKNOWN.

    ``sacct`` lags ``squeue`` by a second or two, so a job ``squeue`` no longer lists but
    ``sacct`` still calls live is asked of ``scontrol`` too. Without accounting (``sacct`` fails)
    ``scontrol`` answers for as long as the controller remembers the job (``MinJobAge``).
    """
    job = parse_job_id(job_id)
    live, why_squeue = _ask("squeue", job, runner, env)
    if live is not None:
        return live
    accounted, why_sacct = _ask("sacct", job, runner, env)
    if accounted is not None and accounted.state.is_finished:
        return accounted
    recent, why_scontrol = _ask("scontrol", job, runner, env)
    if recent is not None:
        return recent
    if accounted is not None:
        return accounted
    hint = f"job {job}: squeue {why_squeue}; sacct {why_sacct}; scontrol {why_scontrol}. "
    hint += "Check the id; without accounting SLURM forgets a job MinJobAge seconds after it ends"
    return JobStatus(JobState.UNKNOWN, "", None, "none", hint=hint)


def job_fields(job_id: str, *, runner: Runner = subprocess_runner) -> dict[str, str] | None:
    """``scontrol show job``'s fields of the job (its first line), or None when the controller
    does not know it or SLURM is not there at all."""
    try:
        done = runner(["scontrol", "show", "job", "--oneliner", parse_job_id(job_id)])
    except SlurmError:
        return None
    found = lines(done.stdout) if done.returncode == 0 else []
    return scontrol_fields(found[0]) if found else None


def job_restarts(job_id: str, *, runner: Runner = subprocess_runner) -> int | None:
    """How many times SLURM requeued the job (``scontrol show job``'s ``Restarts=``, which the
    job sees as ``SLURM_RESTART_COUNT``); None when the controller no longer knows the job."""
    value = (job_fields(job_id, runner=runner) or {}).get("Restarts", "")
    return int(value) if value.isdigit() else None
