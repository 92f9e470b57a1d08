"""The jobs API: load -> plan / dry run -> submit -> record; then status, logs, cancel, wait.

This module owns the orchestration behind ``ddpkit plan|submit|status|logs|cancel`` (the CLI is
a thin layer over it) and the Python-only ``submit_function``. Submission is "dry run plus
schedule": :func:`dry_run` returns exactly the text a submission would hand over (the sbatch
script, or submitit's parameters), and :func:`submit` submits that and writes the job record.
Following a job works from its record when ddpkit submitted it, and from SLURM alone otherwise.
Jobs submitted ``via="torchx"`` are named by torchx's app handle (a slurm one also by its SLURM
job id) and followed by ``ddpkit.jobs.torchx_jobs``, which this module hands them to.
Nothing here prints; following logs yields text for the caller to print.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.errors import ConfigError
from ddpkit.jobs import slurm
from ddpkit.jobs.load import load_spec
from ddpkit.jobs.records import (
    JobRecord,
    Via,
    is_torchx_handle,
    load_record,
    parse_job,
    record_path,
    save_record,
)
from ddpkit.jobs.render import render_sbatch
from ddpkit.jobs.slurm import JobState, JobStatus, SlurmError, parse_job_id

if TYPE_CHECKING:
    import submitit

    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "JobLogs",
    "JobRecord",
    "LogFile",
    "cancel",
    "dry_run",
    "follow_logs",
    "load",
    "log_files",
    "plan",
    "read_logs",
    "status",
    "submit",
    "submit_function",
    "wait",
]

VIAS: tuple[Via, ...] = ("sbatch", "submitit", "torchx")


def load(path: str | Path, overrides: Sequence[str] = (), *, cwd: Path | None = None) -> JobSpec:
    """Read a YAML job spec with ``--set key=value`` overrides (see ``load_spec``)."""
    return load_spec(path, overrides, cwd=cwd)


def plan(spec: JobSpec) -> str:
    """The resolved spec and its rank layout table, as ``ddpkit plan`` prints them."""
    from ddpkit.jobs.layout import format_plan

    return format_plan(spec)


def dry_run(spec: JobSpec, via: Via = "sbatch", *, scheduler: str | None = None) -> str:
    """Exactly what :func:`submit` would hand over: the sbatch script, submitit's parameters or
    torchx's dry run (``scheduler``: torchx's scheduler, only with ``via="torchx"``)."""
    if _check_via(via, scheduler) == "torchx":
        from ddpkit.jobs import torchx_jobs

        return torchx_jobs.dry_run(spec, scheduler or torchx_jobs.DEFAULT_SCHEDULER)
    if via == "submitit":
        from ddpkit.jobs import submitit_backend

        return submitit_backend.dry_run(spec)
    return render_sbatch(spec)


def submit(spec: JobSpec, via: Via = "sbatch", *, scheduler: str | None = None) -> JobRecord:
    """Submit ``spec`` through sbatch, submitit or torchx; write and return the job's record.

    via torchx the job id is torchx's app handle (``record.torchx_handle``).
    """
    if _check_via(via, scheduler) == "torchx":
        from ddpkit.jobs import torchx_jobs

        # no _log_dir: torchx's local scheduler makes its own, slurm's writes to the cwd
        return torchx_jobs.submit(spec, scheduler or torchx_jobs.DEFAULT_SCHEDULER)
    with _log_dir(spec):
        if via == "submitit":
            from ddpkit.jobs import submitit_backend

            job_id, script = submitit_backend.submit_command(spec)
        else:
            script = render_sbatch(spec)
            job_id = slurm.submit_script(script, cwd=Path(spec.workdir))
    record = _record(spec, job_id, via, script)
    save_record(record)
    return record


def submit_function(
    fn: Callable[..., Any], *args: Any, spec: JobSpec, **kwargs: Any
) -> submitit.Job[Any]:
    """Run ``fn(*args, **kwargs)`` in every task of a submitit job with the spec's resources.

    Returns the ``submitit.Job`` (``.result()`` is rank 0's return value, ``.results()`` every
    task's). The job is recorded like any other, so ``ddpkit logs/status/cancel`` know it.
    """
    from ddpkit.jobs import submitit_backend

    job = submitit_backend.submit_function(fn, args, kwargs, spec=spec)
    save_record(_record(spec, str(job.job_id), "submitit", submitit_backend.submitted_script(job)))
    return job


def status(job_id: str) -> JobStatus:
    """The job's state (and exit code when SLURM knows it), with or without accounting.

    ``job_id`` may be a torchx app handle; torchx's failures become UNKNOWN with a hint.
    """
    record = _torchx_record(job_id)
    if record is not None:
        from ddpkit.jobs import torchx_jobs

        return torchx_jobs.status(record)
    return slurm.query_state(parse_job_id(job_id))


def cancel(job_id: str) -> None:
    """Cancel the job: SLURM signals every step and the batch script."""
    record = _torchx_record(job_id)
    if record is not None:
        from ddpkit.jobs import torchx_jobs

        torchx_jobs.cancel(record)
        return
    slurm.cancel(parse_job_id(job_id))


def wait(job_id: str, timeout_s: float = 3600.0, poll_s: float = 1.0) -> JobStatus:
    """Block until the job has finished (any final state); its last status.

    Raises ``SlurmError`` when it is still not finished after ``timeout_s``.
    """
    if _torchx_record(job_id) is None:
        return slurm.wait(parse_job_id(job_id), timeout_s, poll_s)
    deadline = time.monotonic() + timeout_s
    while not (last := status(job_id)).state.is_finished:
        if time.monotonic() >= deadline:
            raise SlurmError(
                f"job {job_id} is still {last.state.value} after timeout_s={timeout_s:g}",
                hint=last.hint or f"wait longer, or stop it with `ddpkit cancel {job_id}`",
            )
        time.sleep(poll_s)
    return last


def _check_via(via: str, scheduler: str | None = None) -> Via:
    if via not in VIAS:
        raise ConfigError(
            f"via {via!r} is not a backend", hint="use 'sbatch', 'submitit' or 'torchx'"
        )
    if scheduler is not None and via != "torchx":
        raise ConfigError(
            f"scheduler={scheduler!r} is for via 'torchx', not via {via!r}",
            hint="add --via torchx, or drop --scheduler",
        )
    return "torchx" if via == "torchx" else "submitit" if via == "submitit" else "sbatch"


def _torchx_record(job: str) -> JobRecord | None:
    """The record of a job submitted via torchx (guessed for a handle ddpkit did not submit)."""
    text = parse_job(job)
    record = load_record(text)
    if record is not None and record.via == "torchx":
        return record
    if not is_torchx_handle(text):
        return None
    from ddpkit.jobs import torchx_jobs

    return torchx_jobs.record_for(text)


def _record(spec: JobSpec, job_id: str, via: Via, script: str | None) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        via=via,
        name=spec.name,
        log_dir=spec.log_path,
        launch="srun" if via == "submitit" else spec.launch,
        nodes=spec.nodes,
        procs_per_node=spec.procs,
        workdir=spec.workdir,
        script=script,
        submitted_at=time.time(),
    )


@contextmanager
def _log_dir(spec: JobSpec) -> Iterator[None]:
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


# --- logs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogFile:
    """One output file of a job; ``rank`` filters a torchrun node file to that rank's lines."""

    path: Path
    label: str  # "batch", "rank 3", "node 1"
    rank: int | None = None

    def select(self, text: str) -> str:
        """The part of ``text`` (whole lines) this view shows."""
        if self.rank is None:
            return text
        prefix = f"[rank{self.rank}]: "
        return "".join(line for line in text.splitlines(True) if line.startswith(prefix))


def log_files(job_id: str, rank: int | None = None) -> tuple[list[LogFile], str]:
    """The job's output files that exist, and a description of where they were looked for.

    Without ``rank``: the batch output, then every rank's file (srun, submitit) or node file
    (torchrun). With ``rank``: that rank's own file, or the node files filtered to its
    ``[rankN]: `` lines. The place comes from the job record, else from SLURM (the batch
    output path), else ``./ddpkit-logs``.
    """
    record = _torchx_record(job_id)
    if record is not None:
        from ddpkit.jobs import torchx_jobs

        return torchx_jobs.log_files(record, rank)
    directory, stem, via, source = _locate(parse_job_id(job_id))
    if via == "submitit":  # <id>_<task>_log.out; the batch output is task 0's file
        batch: list[LogFile] = []
        ranks = _numbered(directory, f"{stem}_", "_log.out")
        nodes: dict[int, Path] = {}
        looked = f"{directory}/{stem}_<N>_log.out ({source})"
    else:
        batch = [LogFile(p, "batch") for p in sorted(directory.glob(f"{stem}.out"))]
        ranks = _numbered(directory, f"{stem}-rank", ".out")
        nodes = _numbered(directory, f"{stem}-node", ".out")
        looked = f"{directory}/{stem}{{,-rank<N>,-node<N>}}.out ({source})"
    if rank is None:
        files = [*batch, *(LogFile(p, f"rank {n}") for n, p in ranks.items())]
        return files + [LogFile(p, f"node {n}") for n, p in nodes.items()], looked
    if rank in ranks:
        return [LogFile(ranks[rank], f"rank {rank}")], looked
    return [LogFile(p, f"node {n}", rank=rank) for n, p in nodes.items()], looked


def _locate(job_id: str) -> tuple[Path, str, Via | None, str]:
    """(log directory, file stem, backend, how it was found) of a job's output files.

    The stem holds a glob for the job name when only the directory is known.
    """
    record = load_record(job_id)
    if record is not None:
        stem = job_id if record.via == "submitit" else f"{record.name}-{job_id}"
        return Path(record.log_dir), stem, record.via, f"job record {record_path(job_id)}"
    source = f"no job record {record_path(job_id)}"
    out = _slurm_output(job_id)
    if out is None:
        guess = Path.cwd() / "ddpkit-logs"
        return guess, f"*-{job_id}", None, f"{source}, SLURM does not know the job"
    source += ", batch output path from scontrol"
    if out.name.startswith(f"{job_id}_"):  # submitit: <folder>/<id>_0_log.out
        return out.parent, job_id, "submitit", source
    # ddpkit's templates: <log_dir>/<name>-<id>.out
    return out.parent, out.name.removesuffix(".out"), "sbatch", source


_STDOUT = re.compile(r"(?:^|\s)StdOut=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_/:]*=|$)")


def _slurm_output(job_id: str) -> Path | None:
    """The batch output file SLURM shows for the job, while the controller remembers it."""
    try:
        done = slurm.subprocess_runner(["scontrol", "show", "job", "--oneliner", job_id])
    except SlurmError:  # no SLURM here at all: the caller says where it looked instead
        return None
    match = _STDOUT.search(done.stdout) if done.returncode == 0 else None
    return Path(match.group(1)) if match else None


def _numbered(directory: Path, prefix: str, suffix: str) -> dict[int, Path]:
    """``{N: path}`` for the files ``<prefix>N<suffix>`` in ``directory``, ordered by N."""
    marker = prefix.rsplit("*", 1)[-1]  # the prefix may start with a glob for the job name
    found: dict[int, Path] = {}
    for path in directory.glob(f"{prefix}*{suffix}"):
        number = path.name.removesuffix(suffix).rsplit(marker, 1)[-1]
        if number.isdigit():
            found[int(number)] = path
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class JobLogs:
    """A job's output as ``ddpkit logs`` prints it, the files it came from, where they were."""

    text: str
    files: list[LogFile]
    looked: str


def read_logs(job_id: str, rank: int | None = None) -> JobLogs:
    """The job's output now; without ``rank`` each file gets a ``==> path <==`` header."""
    files, looked = log_files(job_id, rank)
    parts = []
    for file in files:
        text = file.select(_read_text(file.path))
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

    Only whole lines are yielded while the job runs (a rank filter needs them); what is left
    is flushed at the end. Files that appear later (ranks start after the batch script) are
    picked up on the next poll. A job no SLURM tool knows (UNKNOWN) is not waited for.
    """
    offsets: dict[Path, int] = {}
    pending: dict[Path, bytes] = {}
    current: Path | None = None
    while True:
        state = status(job_id).state  # asked before reading, so the last read sees everything
        finished = state.is_finished or state is JobState.UNKNOWN
        for file in log_files(job_id, rank)[0]:
            text = _read_new(file.path, offsets, pending, flush=finished)
            shown = file.select(text)
            if not shown:
                continue
            if rank is None and file.path != current:
                yield f"==> {file.path} <==\n"
                current = file.path
            yield shown
        if finished:
            return
        sleep(poll_s)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def _read_new(
    path: Path, offsets: dict[Path, int], pending: dict[Path, bytes], *, flush: bool
) -> str:
    """The whole lines added to ``path`` since the last call (everything when ``flush``)."""
    try:
        with path.open("rb") as handle:
            handle.seek(offsets.get(path, 0))
            data = handle.read()
    except FileNotFoundError:
        return ""
    offsets[path] = offsets.get(path, 0) + len(data)
    # bytes until a newline: a multi-byte character may be split between two reads
    data = pending.pop(path, b"") + data
    end = len(data) if flush else data.rfind(b"\n") + 1
    if end < len(data):
        pending[path] = data[end:]
    return data[:end].decode("utf-8", errors="replace")
