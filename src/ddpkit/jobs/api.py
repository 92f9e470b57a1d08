"""The jobs API: load -> plan / dry run -> submit -> record; then status, logs, cancel, wait.

The orchestration behind ``ddpkit plan|submit|status|logs|cancel`` (the CLI is a thin layer)
over the backends' one protocol (:mod:`ddpkit.jobs.backends`): :func:`dry_run` returns exactly
what :func:`submit` hands over. A job is followed by the backend its record names, else through
SLURM (a job id) or torchx (an app handle). Nothing here prints.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.cluster.slurmtools import (
    JobState,
    JobStatus,
    Runner,
    job_restarts,
    poll_until_finished,
    subprocess_runner,
)
from ddpkit.errors import ConfigError
from ddpkit.jobs.backends import (
    Backend,
    Request,
    SweepTask,
    check_scheduler,
    follower,
    get_backend,
)
from ddpkit.jobs.interrupts import held_stop_signals
from ddpkit.jobs.load import load_spec, resolve_spec
from ddpkit.jobs.logs import JobLogs, LogFile, read_new, read_text
from ddpkit.jobs.records import (
    JobRecord,
    Via,
    load_record,
    parse_job,
    recorded_run_id,
    save_record,
    split_handle,
)

if TYPE_CHECKING:
    import submitit

    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "RunOfJob",
    "cancel",
    "check_sweep_environment",
    "dry_run",
    "follow_logs",
    "load",
    "log_files",
    "map_function",
    "plan",
    "read_logs",
    "request",
    "resolve",
    "run_of",
    "schedule",
    "status",
    "submit",
    "submit_function",
    "sweep_status",
    "wait",
]


load = load_spec  # the spec file with its --set and --sweep overrides, validated
resolve = resolve_spec  # load, and the profile file merged into the spec (.profile_path)


def plan(spec: JobSpec, profile_path: Path | None = None) -> str:
    """The resolved spec and its rank layout table, as ``ddpkit plan`` prints them (with the
    profile file the spec's values came from, when given)."""
    from ddpkit.jobs.layout import format_plan

    return format_plan(spec, profile_path)


def request(spec: JobSpec, via: Via = "sbatch", *, scheduler: str | None = None) -> Request:
    """What submitting ``spec`` through ``via`` would hand over (``scheduler``: torchx's, only
    with ``via="torchx"``); nothing is submitted or written."""
    check_scheduler(via, scheduler)
    check_sweep_environment(spec)
    return get_backend(via).dry_run(spec, scheduler)


def check_sweep_environment(spec: JobSpec) -> None:
    """Refuse a sweep submitted from an environment that sets ``DDPKIT_RUN_ID``: sbatch and
    submitit hand it to every task, which would then all be one run (its spec's ``env`` may not
    set it either: :class:`~ddpkit.jobs.spec.JobSpec`)."""
    from ddpkit.contract import RUN_ID_MAX_CHARS, RUN_ID_VAR
    from ddpkit.jobs.sweep_spec import SHARED_RUN_ID, SHARED_RUN_ID_HINT

    value = os.environ.get(RUN_ID_VAR, "")
    if spec.sweep is not None and value:
        raise ConfigError(
            f"{RUN_ID_VAR}={value[: RUN_ID_MAX_CHARS + 8]!r} (set where the sweep is "
            f"submitted) {SHARED_RUN_ID}",
            hint=f"unset it: {SHARED_RUN_ID_HINT}",
        )


def dry_run(spec: JobSpec, via: Via = "sbatch", *, scheduler: str | None = None) -> str:
    """Exactly what :func:`submit` would hand over: the sbatch script, submitit's parameters or
    torchx's dry run."""
    return request(spec, via, scheduler=scheduler).text


def submit(spec: JobSpec, via: Via = "sbatch", *, scheduler: str | None = None) -> JobRecord:
    """Submit ``spec`` through sbatch, submitit or torchx; write and return the job's record.

    Via torchx the job is named by torchx's app handle (``record.handle``).
    """
    return schedule(request(spec, via, scheduler=scheduler))


def schedule(wanted: Request) -> JobRecord:
    """Submit what :func:`request` returned (its ``notes`` are for the user); write and
    return the job's record."""
    with held_stop_signals(enabled=not wanted.foreground):  # no job without its record
        record = get_backend(wanted.via).schedule(wanted)
        save_record(record)
    return record


def submit_function(
    fn: Callable[..., Any], *args: Any, spec: JobSpec, **kwargs: Any
) -> submitit.Job[Any]:
    """Run ``fn(*args, **kwargs)`` in every task of a submitit job with the spec's resources.

    Returns the ``submitit.Job`` (``.result()`` is rank 0's return value, ``.results()`` every
    task's). The job is recorded like any other, so ``ddpkit logs/status/cancel`` know it.
    """
    from ddpkit.jobs.backends import submitit as submitit_backend

    with held_stop_signals():  # no job without its record (see schedule)
        job = submitit_backend.make_executor(spec).submit(fn, *args, **kwargs)
        save_record(submitit_backend.job_record(spec, job))
    return job


def map_function(fn: Callable[..., Any], *, spec: JobSpec) -> list[submitit.Job[Any]]:
    """Run ``fn(**values)`` once per run of the spec's sweep, as one SLURM array through
    submitit's ``map_array`` (values as text); the array is recorded like ``submit``'s, so
    ``ddpkit status/logs/cancel`` know it. Returns the tasks' ``submitit.Job`` objects."""
    from ddpkit.jobs.backends import submitit as submitit_backend

    check_sweep_environment(spec)
    with held_stop_signals():  # no array without its record (see schedule)
        jobs = submitit_backend.map_function(fn, spec=spec)
        save_record(submitit_backend.sweep_record(spec, jobs))
    return jobs


def _follow(job: str) -> tuple[Backend, str, JobRecord | None]:
    """(backend, job id, record) of a job: the backend its record names; without a record,
    torchx for an app handle and SLURM (the sbatch backend's following) for a job id."""
    text = parse_job(job)
    record = load_record(text)
    return follower(text, record), text, record


def status(job_id: str) -> JobStatus:
    """The job's state (and exit code when SLURM knows it), with or without accounting.

    ``job_id`` may be a torchx app handle; torchx's failures become UNKNOWN with a hint.
    """
    backend, job, record = _follow(job_id)
    return backend.status(job, record)


@dataclass(frozen=True)
class RunOfJob:
    """The run a job's ranks belong to: its run id and, while SLURM remembers the job, the
    attempt (SLURM's requeue count: ddpkit's job scripts restart no workers themselves)."""

    run_id: str
    attempt: int | None


def run_of(job_id: str, *, runner: Runner = subprocess_runner) -> RunOfJob | None:
    """The run id (from the job's record) and attempt (``scontrol show job``'s ``Restarts=``)
    of a job ddpkit submitted; None when its record does not name the run (no record, one
    written before run ids were kept, a local torchx app without ``DDPKIT_RUN_ID``)."""
    job = parse_job(job_id)
    record = load_record(job)
    run_id = recorded_run_id(record, job)
    if run_id is None or record is None:
        return None
    slurm_job: str | None = job
    if record.handle is not None:  # an app handle: its scheduler's job id is in it
        scheduler, app_id = split_handle(record.handle)
        slurm_job = app_id if scheduler == "slurm" else None
    attempt = None if slurm_job is None else job_restarts(slurm_job, runner=runner)
    return RunOfJob(run_id, attempt)


def sweep_status(job_id: str) -> list[SweepTask] | None:
    """Every task of a sweep ddpkit submitted, in task order: its state, run name, run id and
    attempt, each SLURM tool asked once for the whole array; None when ``job_id`` is not a
    sweep's array id (a single task ``123_4`` included: :func:`status` answers for it)."""
    backend, job, record = _follow(job_id)
    return backend.sweep_status(job, record)


def cancel(job_id: str) -> None:
    """Cancel the job: SLURM signals every step and the batch script."""
    backend, job, record = _follow(job_id)
    backend.cancel(job, record)


def wait(
    job_id: str,
    timeout_s: float = 3600.0,
    poll_s: float = 1.0,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> JobStatus:
    """Block until the job has finished (any final state); its last status.

    Raises ``SlurmError`` when it is still not finished after ``timeout_s``.
    """
    return poll_until_finished(
        lambda: status(job_id), job_id, timeout_s, poll_s, clock=clock, sleep=sleep
    )


# --- logs -------------------------------------------------------------------------------------


def log_files(job_id: str, rank: int | None = None) -> tuple[list[LogFile], str]:
    """The job's output files that exist, and a description of where they were looked for.

    Without ``rank``: the batch output, then every rank's file (srun, submitit) or node file
    (torchrun). With ``rank``: that rank's own file, or the node files filtered to its
    ``[rankN]: `` lines. The place comes from the job record, else from SLURM (the batch
    output path), else ``./ddpkit-logs``.
    """
    backend, job, record = _follow(job_id)
    return backend.log_files(job, record, rank)


def read_logs(job_id: str, rank: int | None = None) -> JobLogs:
    """The job's output now; without ``rank`` each file gets a ``==> path <==`` header."""
    files, looked = log_files(job_id, rank)
    parts = []
    for file in files:
        text = file.select(read_text(file.path))
        parts.append(f"==> {file.path} <==\n{text}" if rank is None else text)
    return JobLogs("".join(parts), files, looked)


def follow_logs(
    job_id: str,
    rank: int | None = None,
    *,
    poll_s: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[str]:
    """Yield the job's output as it is written until the job has finished (like ``tail -f``).

    Readable with many ranks: only whole lines are yielded while the job runs, so lines of two
    ranks never mix, and each line starts with its file's label, ``[rank 3] `` (``[batch] ``,
    ``[node 1] ``, in a sweep ``[task 2 rank 3] ``), where the files are several (no ``rank``,
    or a sweep's tasks); one rank's own output comes as it is. What is left of a last line is
    flushed at the end, ended by a newline. Files that appear later (ranks start after the
    batch script) are picked up on the next poll. A job no SLURM tool knows (UNKNOWN) is not
    waited for.
    """
    offsets: dict[Path, int] = {}
    pending: dict[Path, bytes] = {}
    while True:
        state = status(job_id).state  # asked before reading, so the last read sees everything
        finished = state.is_finished or state is JobState.UNKNOWN
        files = log_files(job_id, rank)[0]
        labelled = rank is None or any(file.label.startswith("task ") for file in files)
        for file in files:
            shown = file.select(read_new(file.path, offsets, pending, flush=finished))
            if not shown:
                continue
            if labelled:
                lines = shown.splitlines()
                yield "".join(f"[{file.label}] {line}\n" for line in lines)
            else:
                yield shown
        if finished:
            return
        sleep(poll_s)
