"""The ``sbatch`` backend: a script from ddpkit's templates, submitted with ``sbatch``.

Also home of :class:`SlurmJobs`, how any job that runs on SLURM is followed (state from
squeue / sacct / scontrol, ``scancel``, the output files of ddpkit's templates and of
submitit), which the submitit backend shares, and of :func:`log_dir_made`, the log folder a
submission creates and removes again when it fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.cluster import slurmtools as slurm
from ddpkit.cluster.slurmtools.config import max_array_size, show_config
from ddpkit.errors import ConfigError
from ddpkit.jobs.backend import Request
from ddpkit.jobs.logs import LogFile, slurm_log_files
from ddpkit.jobs.records import JobRecord, Via, new_record
from ddpkit.jobs.render import render_sbatch

if TYPE_CHECKING:
    from ddpkit.cluster.slurmtools import JobStatus
    from ddpkit.jobs.spec import JobSpec

__all__ = ["BACKEND", "SbatchBackend", "SlurmJobs", "check_array_size", "log_dir_made"]


class SlurmJobs:
    """Following a job that SLURM runs: by its SLURM job id, with or without a record."""

    via: Via = "sbatch"

    def status(self, job_id: str, record: JobRecord | None) -> JobStatus:
        return slurm.query_state(slurm.parse_job_id(job_id))

    def cancel(self, job_id: str, record: JobRecord | None) -> None:
        slurm.cancel(slurm.parse_job_id(job_id))

    def log_files(
        self, job_id: str, record: JobRecord | None, rank: int | None
    ) -> tuple[list[LogFile], str]:
        return slurm_log_files(slurm.parse_job_id(job_id), record, rank)


class SbatchBackend(SlurmJobs):
    """The script ``ddpkit submit --dry-run`` prints is the text sbatch reads on stdin."""

    via: Via = "sbatch"

    def dry_run(self, spec: JobSpec, scheduler: str | None = None) -> Request:
        script = render_sbatch(spec)
        return Request(self.via, spec, script, payload=script)

    def schedule(self, request: Request) -> JobRecord:
        spec, script = request.spec, str(request.payload)
        check_array_size(spec)
        with log_dir_made(spec):
            job_id = slurm.submit_script(script, cwd=Path(spec.workdir))
        return new_record(spec, job_id, self.via, script)


BACKEND = SbatchBackend()


def check_array_size(spec: JobSpec, *, runner: slurm.Runner = slurm.subprocess_runner) -> None:
    """Refuse a sweep with more tasks than the cluster's ``MaxArraySize`` allows (indices
    0..MaxArraySize-1), before anything is written; unchecked when SLURM does not say."""
    if spec.sweep is None:
        return
    limit = max_array_size(show_config(runner=runner))
    count = spec.sweep.count
    if limit is not None and count > limit:
        raise ConfigError(
            f"sweep has {count} runs, more than this cluster's MaxArraySize={limit} allows "
            f"(array indices 0-{limit - 1})",
            hint="split the sweep (fewer values per submission) or ask the admins to raise "
            "MaxArraySize in slurm.conf",
        )


@contextmanager
def log_dir_made(spec: JobSpec) -> Iterator[None]:
    """Create the log directory (SLURM opens the output files in it before the job starts).

    If the submission fails, the directories this made are removed again (only empty ones):
    a failed submit leaves nothing behind.
    """
    path = Path(spec.log_path)
    created = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for made in created:
            try:
                made.rmdir()
            except OSError:
                break
        raise
