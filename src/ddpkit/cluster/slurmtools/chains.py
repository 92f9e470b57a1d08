"""What job chains need from SLURM: the job ids a job name stands for, and why a job waits.

:func:`jobs_named` asks ``squeue`` (live jobs), then ``sacct`` (jobs accounting remembers; by
default those since midnight) for the current user's jobs of one name, newest first.
:func:`pending_reason` reads ``scontrol show job``'s ``Reason=`` and :data:`REASONS` says in
words what a dependency's reason means: ``DependencyNeverSatisfied`` is SLURM's word for "a job
this one waits for ended in a way its dependency does not accept", and such a job never starts
(unless the site kills it: ``SchedulerParameters=kill_invalid_depend``).
"""

from __future__ import annotations

import re

from ddpkit.cluster.slurmtools.query import job_fields
from ddpkit.cluster.slurmtools.runner import Runner, SlurmError, lines, subprocess_runner

__all__ = ["REASONS", "jobs_named", "pending_reason", "reason_hint"]

# a job id as squeue/sacct print it: a plain job, an array task (123_4) or tasks (123_[5-9])
_LISTED_ID = re.compile(r"([0-9]+)(?:_(?:[0-9]+|\[[^\]]*\]))?")

REASONS: dict[str, str] = {
    "DependencyNeverSatisfied": (
        "it waits for a job that ended in a way its dependency does not accept (afterok: that "
        "job failed, was cancelled or timed out), so it will never start; cancel it "
        "(ddpkit cancel JOB) and submit again once the job it waits for has completed"
    ),
    "Dependency": "it waits for the jobs it depends on (its after: list) to end",
}


def _ids(stdout: str) -> list[str]:
    """The job ids listed, newest (highest) first; an array's tasks stand for the array, whose
    id a dependency on the whole array names (afterok:123 waits for every task)."""
    found = [_LISTED_ID.fullmatch(line.split("|")[0]) for line in lines(stdout)]
    ids = {int(match[1]) for match in found if match is not None}
    return [str(job) for job in sorted(ids, reverse=True)]


def jobs_named(name: str, *, runner: Runner = subprocess_runner) -> list[str]:
    """The current user's job ids of job name ``name``, newest first: squeue's live ones, else
    those sacct remembers; [] when neither knows one (or neither can be asked)."""
    asks = [
        ["squeue", "--me", "--noheader", "--format=%i", f"--name={name}"],
        ["sacct", "--noheader", "--allocations", "--parsable2", "--format=JobID", f"--name={name}"],
    ]
    for argv in asks:
        try:
            done = runner(argv)
        except SlurmError:
            continue
        if done.returncode == 0 and _ids(done.stdout):
            return _ids(done.stdout)
    return []


def pending_reason(job_id: str, *, runner: Runner = subprocess_runner) -> str | None:
    """scontrol's ``Reason=`` of the job (``Dependency``, ``DependencyNeverSatisfied``, ...),
    None when the controller does not know the job or gives none."""
    reason = (job_fields(job_id, runner=runner) or {}).get("Reason", "")
    return reason if reason and reason != "None" else None


def reason_hint(job_id: str, reason: str | None) -> str | None:
    """What ``ddpkit status`` says about a waiting job whose reason is a dependency's."""
    if reason not in REASONS:
        return None
    return f"job {job_id}: SLURM's reason is {reason}: {REASONS[reason]}"
