"""Job chains at submission: the names in a spec's ``after:`` become SLURM job ids.

A name stands for the newest job of that name: in ddpkit's job records first, then in SLURM
(:func:`ddpkit.cluster.slurmtools.jobs_named`). A name nobody knows is a ``ConfigError`` before
anything is submitted: sbatch would refuse the job, or (a typo) wait on the wrong one. Job ids
pass as they are; SLURM checks them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.cluster import slurmtools as slurm
from ddpkit.errors import ConfigError
from ddpkit.jobs.records import ddpkit_home, load_record
from ddpkit.jobs.spec_chain import is_dependency_id

if TYPE_CHECKING:
    from ddpkit.jobs.spec import JobSpec

__all__ = ["recorded_jobs_named", "resolve_after"]


def recorded_jobs_named(name: str, *, home: Path | None = None) -> list[str]:
    """The SLURM job ids of ddpkit's records of job name ``name``, newest submission first
    (records of jobs not on SLURM, a local torchx app, are skipped)."""
    folder = (ddpkit_home() if home is None else home) / "jobs"
    found: list[tuple[float, str]] = []
    for path in sorted(folder.glob("*.json")):
        try:
            if json.loads(path.read_text(encoding="utf-8")).get("name") != name:
                continue  # cheap pre-check: most records are of other names
        except (OSError, ValueError, AttributeError):
            continue
        try:
            record = load_record(path.stem, home=home)
        except ConfigError:  # a local torchx app's record (not a job id) or a damaged file
            continue
        if record is not None and is_dependency_id(record.job_id):
            found.append((record.submitted_at, record.job_id))
    return [job for _, job in sorted(found, reverse=True)]


def resolve_after(
    spec: JobSpec, *, runner: slurm.Runner = slurm.subprocess_runner, home: Path | None = None
) -> JobSpec:
    """``spec`` with every name in ``after`` replaced by its newest job's id (the spec itself
    when it has no names); a ConfigError naming the first name that no job has."""
    if all(is_dependency_id(ref) for ref in spec.after):
        return spec
    ids = []
    for ref in spec.after:
        if is_dependency_id(ref):
            ids.append(ref)
            continue
        known = recorded_jobs_named(ref, home=home) or slurm.jobs_named(ref, runner=runner)
        if not known:
            folder = (ddpkit_home() if home is None else home) / "jobs"
            raise ConfigError(
                f"after={ref!r}: no job of that name in ddpkit's records ({folder}) or SLURM's "
                "squeue/sacct",
                hint="check the name (ddpkit status shows a job's), give its job id, or submit "
                "that job first",
            )
        ids.append(known[0])
    return spec.model_copy(update={"after": list(dict.fromkeys(ids))})
