"""SLURM job arrays (a sweep's runs): the state and requeue count of every task at once.

Each tool is asked once for the whole array (``squeue --array``, ``sacct``, ``scontrol show
job``), whose rows name tasks (``123_4``) or, for pending ones, ranges (``123_[5-9%2]``); each
task then gets its answer in :func:`ddpkit.cluster.slurmtools.query_state`'s order, and its
requeue count from the same ``scontrol`` answer (``Restarts=``, per task: a requeued task has a
line of its own). One task's own state, cancel and requeue need nothing here: ``123_4`` is a job
id to every SLURM tool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddpkit.cluster.slurmtools.query import Row, covers, parse_job_id, row_status, tool_rows
from ddpkit.cluster.slurmtools.runner import Runner, subprocess_runner
from ddpkit.cluster.slurmtools.states import JobState, JobStatus, Source
from ddpkit.errors import ConfigError

__all__ = ["ArrayTasks", "query_array"]


def _task_statuses(rows: Sequence[Row], array: str, source: Source) -> dict[int, JobStatus]:
    """``{task: status}`` from rows naming tasks (``123_4``); ranges stay in the rows."""
    found: dict[int, JobStatus] = {}
    for row in rows:
        base, _, task = row.job_id.partition("_")
        if base == array and task.isdigit():
            found.setdefault(int(task), row_status(row, source))
    return found


@dataclass(frozen=True)
class ArrayTasks:
    """What SLURM says of a job array's tasks: each task's ``states``, and ``restarts`` (how
    many times SLURM requeued it, ``scontrol``'s ``Restarts=``) for the tasks the controller
    still knows (a task it has forgotten has none)."""

    states: dict[int, JobStatus]
    restarts: dict[int, int]


def query_array(
    job_id: str | int, count: int | None = None, *, runner: Runner = subprocess_runner
) -> ArrayTasks:
    """The state of every task of the job array ``job_id`` (tasks 0..count-1, or those the
    tools list), each tool asked once for the whole array, in :func:`query_state`'s order:
    squeue (live) -> sacct when it says finished -> scontrol -> sacct -> UNKNOWN; and the
    requeue count of each task ``scontrol`` lists.

    A pending range (``123_[2-5%2]``) stands for each of its tasks.
    """
    array = parse_job_id(job_id)
    if not array.isdigit():
        raise ConfigError(
            f"job_id={array!r} is not an array's job id",
            hint="give the array's own id (123), not one task (123_4)",
        )
    answers: dict[Source, tuple[list[Row], dict[int, JobStatus]]] = {}
    for source in ("squeue", "sacct", "scontrol"):
        rows, _ = tool_rows(source, array, runner, None)
        answers[source] = (rows, _task_statuses(rows, array, source))
    known = set() if count is None else set(range(count))
    for _, explicit in answers.values():
        known |= set(explicit)
    result: dict[int, JobStatus] = {}
    restarts: dict[int, int] = {}
    for task in sorted(known):
        wanted = f"{array}_{task}"
        found: dict[Source, JobStatus] = {}
        for source, (rows, explicit) in answers.items():
            if task in explicit:
                found[source] = explicit[task]
            else:
                row = next((r for r in rows if covers(r.job_id, wanted)), None)
                if row is not None:
                    found[source] = row_status(row, source)
        result[task] = _pick(found, wanted)
        count_of = _restarts(answers["scontrol"][0], wanted)
        if count_of is not None:
            restarts[task] = count_of
    return ArrayTasks(result, restarts)


def _restarts(rows: Sequence[Row], task: str) -> int | None:
    """``Restarts=`` of the scontrol row of ``task`` (``123_4``), its own or its range's."""
    own = next((row for row in rows if row.job_id == task), None)
    row = own or next((row for row in rows if covers(row.job_id, task)), None)
    return None if row is None else row.restarts


def _pick(found: Mapping[Source, JobStatus], job: str) -> JobStatus:
    if "squeue" in found:
        return found["squeue"]
    accounted = found.get("sacct")
    if accounted is not None and accounted.state.is_finished:
        return accounted
    if "scontrol" in found:
        return found["scontrol"]
    if accounted is not None:
        return accounted
    hint = f"no SLURM tool lists {job}; without accounting SLURM forgets it MinJobAge s after"
    return JobStatus(JobState.UNKNOWN, "", None, "none", hint=hint)
