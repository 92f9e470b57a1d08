"""The ``sbatch`` backend: a script from ddpkit's templates, submitted with ``sbatch``.

Also home of :class:`SlurmJobs`, how any job on SLURM is followed (the submitit backend shares
it), and of the log layout of ddpkit's templates (``<log_dir>/<name>-<id>.out``,
``-rank<N>.out``, ``-node<N>.out``; a sweep's rank files in its run's folder). A
``snapshot: true`` job's files are copied at submission (:mod:`ddpkit.jobs.snapshot`).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.cluster import slurmtools as slurm
from ddpkit.cluster.slurmtools.arrays import query_array
from ddpkit.cluster.slurmtools.config import max_array_size, show_config
from ddpkit.cluster.slurmtools.states import JobState
from ddpkit.errors import ConfigError
from ddpkit.jobs.backends import Request, SweepTask, get_backend
from ddpkit.jobs.chain import resolve_after
from ddpkit.jobs.logs import LogFile, numbered, pick, slurm_stdout, sweep_log_files
from ddpkit.jobs.records import JobRecord, Via, new_record, record_path, recorded_run_id
from ddpkit.jobs.render import render_sbatch
from ddpkit.jobs.snapshot import copy_tracked, snapshotted

if TYPE_CHECKING:
    from ddpkit.cluster.slurmtools import JobStatus
    from ddpkit.jobs.spec import JobSpec

__all__ = ["BACKEND", "SbatchBackend", "SlurmJobs", "check_array_size", "log_dir_made"]


class SlurmJobs:
    """Following a job that SLURM runs: by its SLURM job id, with or without a record."""

    def status(self, job_id: str, record: JobRecord | None) -> JobStatus:
        return waiting_explained(slurm.query_state(slurm.parse_job_id(job_id)), job_id)

    def cancel(self, job_id: str, record: JobRecord | None) -> None:
        slurm.cancel(slurm.parse_job_id(job_id))

    def sweep_status(self, job_id: str, record: JobRecord | None) -> list[SweepTask] | None:
        runs = None if record is None else record.sweep_runs
        if runs is None or not job_id.isdigit():
            return None
        found = query_array(job_id, len(runs))  # one call per SLURM tool, however many tasks
        tasks = []
        for index, run in enumerate(runs):
            task = f"{job_id}_{index}"
            # the requeue count is the attempt of ddpkit's job scripts, as in api.run_of
            attempt = found.restarts.get(index)
            run_id = recorded_run_id(record, task)
            tasks.append(SweepTask(task, found.states[index], run, run_id, attempt))
        return tasks

    def log_files(
        self, job_id: str, record: JobRecord | None, rank: int | None
    ) -> tuple[list[LogFile], str]:
        job = slurm.parse_job_id(job_id)
        if record is None:
            return unrecorded_log_files(job, rank)
        if record.sweep_runs is not None:
            return self.sweep_files(job, record, rank)
        source = f"job record {record_path(job)}"
        return self.files_at(Path(record.log_dir), job, rank, self.stem(job, record), source)

    def stem(self, job: str, record: JobRecord) -> str:
        """The start of a recorded job's file names: ``<name>-<id>`` (ddpkit's templates)."""
        return f"{record.name}-{job}"

    def files_at(
        self, directory: Path, job: str, rank: int | None, stem: str, source: str
    ) -> tuple[list[LogFile], str]:
        """The files of ``job`` in ``directory``, named ``<stem>.out`` and so on (the stem may
        start with a glob for the job name); ``source`` says how the place was found."""
        # an array task's rank files may lie in its run's folder (a sweep without its record)
        rank_dirs = [directory, *sorted(d for d in directory.glob("*/") if d.is_dir())]
        if "_" not in job:
            rank_dirs = rank_dirs[:1]
        looked = f"{directory}/{stem}{{,-rank<N>,-node<N>}}.out ({source})"
        return template_files(directory, rank_dirs, stem, rank), looked

    def sweep_files(
        self, job: str, record: JobRecord, rank: int | None
    ) -> tuple[list[LogFile], str]:
        """A sweep's files: batch output beside the others, rank files in the run's folder."""

        def task_files(directory: Path, array: str, task: int, run: str) -> list[LogFile]:
            stem = f"{record.name}-{array}_{task}"
            return template_files(directory, [directory / run], stem, rank)

        array, name, directory = job.partition("_")[0], record.name, record.log_dir
        pattern = (
            f"{directory}/{name}-{array}_<task>.out and {directory}/<run>/{name}-"
            f"{array}_<task>{{-rank<N>,-node<N>}}.out"
        )
        return sweep_log_files(job, record, rank, task_files, pattern)


def waiting_explained(
    status: JobStatus, job_id: str, *, runner: slurm.Runner = slurm.subprocess_runner
) -> JobStatus:
    """``status`` with a hint when the job waits on a dependency (an ``after:`` job), above all
    one that can never be satisfied: SLURM keeps such a job PENDING (or, with
    ``kill_invalid_depend``, cancels it) and only its reason says why it never runs."""
    if status.hint is not None or status.state not in (JobState.PENDING, JobState.CANCELLED):
        return status
    hint = slurm.reason_hint(job_id, slurm.pending_reason(job_id, runner=runner))
    return status if hint is None else replace(status, hint=hint)


def template_files(
    batch_dir: Path, rank_dirs: list[Path], stem: str, rank: int | None
) -> list[LogFile]:
    """The files of one job (or array task) named ``<stem>.out``, ``<stem>-rank<N>.out``,
    ``<stem>-node<N>.out``; the rank files in the first of ``rank_dirs`` that has any."""
    batch = [LogFile(p, "batch") for p in sorted(batch_dir.glob(f"{stem}.out"))]
    ranks: dict[int, Path] = {}
    nodes: dict[int, Path] = {}
    for folder in rank_dirs:
        ranks = numbered(folder, f"{stem}-rank", ".out")
        nodes = numbered(folder, f"{stem}-node", ".out")
        if ranks or nodes:
            break
    return pick(rank, batch, ranks, nodes)


def unrecorded_log_files(job: str, rank: int | None) -> tuple[list[LogFile], str]:
    """The files of a SLURM job without a record: where SLURM's batch output path is, in the
    layout that path's name shows (submitit's ``<id>_0_log.out``, else ddpkit's templates'
    ``<name>-<id>.out``); without SLURM's answer, ``./ddpkit-logs`` in the templates' layout."""
    source = f"no job record {record_path(job)}"
    out = slurm_stdout(job)
    if out is None:
        guess = Path.cwd() / "ddpkit-logs"
        why = f"{source}, SLURM does not know the job"
        return BACKEND.files_at(guess, job, rank, f"*-{job}", why)
    source += ", batch output path from scontrol"
    if out.name.startswith(f"{job}_"):
        submitit: SlurmJobs = get_backend("submitit")  # type: ignore[assignment]
        return submitit.files_at(out.parent, job, rank, job, source)
    return BACKEND.files_at(out.parent, job, rank, out.name.removesuffix(".out"), source)


class SbatchBackend(SlurmJobs):
    """The script ``ddpkit submit --dry-run`` prints is the text sbatch reads on stdin."""

    via: Via = "sbatch"

    def dry_run(self, spec: JobSpec, scheduler: str | None = None) -> Request:
        """The text is the script; the payload, under ``snapshot: true``, the workdir whose
        files are copied at submission (the spec's workdir is the copy's folder by then)."""
        spec = resolve_after(spec)  # after: names -> job ids, before anything is shown
        source = spec.workdir if spec.snapshot else None
        spec = snapshotted(spec)  # snapshot: true: the job's workdir is the copy to be made
        return Request(self.via, spec, render_sbatch(spec), payload=source)

    def schedule(self, request: Request) -> JobRecord:
        spec, script, source = request.spec, request.text, request.payload
        with log_dir_made(spec), array_refusal_explained(spec), snapshot_made(spec, source):
            job_id = slurm.submit_script(script, cwd=Path(spec.workdir))
        return new_record(spec, job_id, self.via, script)


@contextmanager
def snapshot_made(spec: JobSpec, source: str | None) -> Iterator[None]:
    """Copy the tracked files of ``source`` (None: no snapshot) into the spec's workdir before
    the submission inside; if it fails, remove the copy again (a job that was never submitted
    has no snapshot)."""
    if source is None:
        yield
        return
    copy_tracked(source, spec.workdir)
    try:
        yield
    except BaseException:
        shutil.rmtree(spec.workdir, ignore_errors=True)
        with suppress(OSError):  # snapshots/, if this made it: log_dir_made removes the rest
            Path(spec.workdir).parent.rmdir()
        raise


BACKEND = SbatchBackend()


def check_array_size(spec: JobSpec, *, runner: slurm.Runner = slurm.subprocess_runner) -> None:
    """Refuse a sweep with more tasks than the cluster's ``MaxArraySize`` allows, before
    anything is written (unchecked when SLURM does not say). submitit calls it first, as it
    writes a pickle per task; sbatch only once sbatch refused (:func:`array_refusal_explained`)."""
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
def array_refusal_explained(
    spec: JobSpec, *, runner: slurm.Runner = slurm.subprocess_runner
) -> Iterator[None]:
    """When the submission inside fails and the sweep has more tasks than ``MaxArraySize``
    allows, the error says so (sbatch's own, "Invalid job array specification", does not);
    any other failure passes unchanged."""
    try:
        yield
    except slurm.SlurmError:
        check_array_size(spec, runner=runner)
        raise


@contextmanager
def log_dir_made(spec: JobSpec) -> Iterator[None]:
    """Create the log directory (SLURM opens the output files in it before the job starts);
    if the submission fails, remove the empty directories this made: nothing is left behind."""
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
