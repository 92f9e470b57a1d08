"""Where a job's output is, and reading it: one ``LogFile`` per file, whatever the backend.

Backends say which files a job has (``Backend.log_files``); this module holds the view they
return (:class:`LogFile`, with its per-rank filter), the lookup of the files of a job that ran
on SLURM through ddpkit's templates or submitit (:func:`slurm_log_files`), and the readers that
``ddpkit logs`` (``--follow``) uses. It imports no backend, so every backend can import it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ddpkit.cluster.slurmtools.query import job_fields
from ddpkit.cluster.slurmtools.runner import Runner, subprocess_runner
from ddpkit.jobs.records import JobRecord, record_path

__all__ = ["JobLogs", "LogFile", "read_new", "read_text", "slurm_log_files"]


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


@dataclass(frozen=True)
class JobLogs:
    """A job's output as ``ddpkit logs`` prints it, the files it came from, where they were."""

    text: str
    files: list[LogFile]
    looked: str


def slurm_log_files(
    job_id: str,
    record: JobRecord | None,
    rank: int | None = None,
    *,
    runner: Runner = subprocess_runner,
) -> tuple[list[LogFile], str]:
    """The output files of a SLURM job that exist, and a description of where they were looked for.

    Without ``rank``: the batch output, then every rank's file (srun, submitit) or node file
    (torchrun). With ``rank``: that rank's own file, or the node files filtered to its
    ``[rankN]: `` lines. The place comes from the job record, else from SLURM (the batch
    output path), else ``./ddpkit-logs``. A sweep's array (``123``) lists every task's files,
    labelled ``task 3 rank 1``; one task (``123_3``) only its own, from its run's folder.
    """
    if record is not None and record.sweep_runs is not None:
        return _sweep_log_files(job_id, record, rank)
    directory, stem, via, source = _locate(job_id, record, runner)
    if via == "submitit":  # <id>_<task>_log.out; the batch output is task 0's file
        ranks = _numbered(directory, f"{stem}_", "_log.out")
        looked = f"{directory}/{stem}_<N>_log.out ({source})"
        return _pick(rank, [], ranks, {}), looked
    # an array task's rank files may lie in its run's folder (a sweep without its record)
    rank_dirs = [directory, *sorted(d for d in directory.glob("*/") if d.is_dir())]
    if "_" not in job_id:
        rank_dirs = rank_dirs[:1]
    looked = f"{directory}/{stem}{{,-rank<N>,-node<N>}}.out ({source})"
    return _files(directory, rank_dirs, stem, rank), looked


def _sweep_log_files(job_id: str, record: JobRecord, rank: int | None) -> tuple[list[LogFile], str]:
    runs = record.sweep_runs or ()
    array, _, task = job_id.partition("_")
    indices = [int(task)] if task.isdigit() else list(range(len(runs)))
    directory = Path(record.log_dir)
    files = []
    for index in indices:
        if index >= len(runs):
            continue
        if record.via == "submitit":  # <folder>/<array>_<task>_<rank>_log.out
            ranks = _numbered(directory, f"{array}_{index}_", "_log.out")
            found = _pick(rank, [], ranks, {})
        else:
            stem = f"{record.name}-{array}_{index}"
            found = _files(directory, [directory / runs[index]], stem, rank)
        label = f"task {index} " if not task else ""
        files += [replace(file, label=label + file.label) for file in found]
    looked = (
        f"{directory}/{record.name}-{array}_<task>.out and {directory}/<run>/{record.name}-"
        f"{array}_<task>{{-rank<N>,-node<N>}}.out"
        if record.via != "submitit"
        else f"{directory}/{array}_<task>_<N>_log.out"
    ) + f" (job record {record_path(array)})"
    return files, looked


def _files(batch_dir: Path, rank_dirs: list[Path], stem: str, rank: int | None) -> list[LogFile]:
    """The files of one job (or array task) named ``<stem>.out``, ``<stem>-rank<N>.out``,
    ``<stem>-node<N>.out``; the rank files in the first of ``rank_dirs`` that has any."""
    batch = [LogFile(p, "batch") for p in sorted(batch_dir.glob(f"{stem}.out"))]
    ranks: dict[int, Path] = {}
    nodes: dict[int, Path] = {}
    for folder in rank_dirs:
        ranks = _numbered(folder, f"{stem}-rank", ".out")
        nodes = _numbered(folder, f"{stem}-node", ".out")
        if ranks or nodes:
            break
    return _pick(rank, batch, ranks, nodes)


def _pick(
    rank: int | None, batch: list[LogFile], ranks: dict[int, Path], nodes: dict[int, Path]
) -> list[LogFile]:
    if rank is None:
        files = [*batch, *(LogFile(p, f"rank {n}") for n, p in ranks.items())]
        return files + [LogFile(p, f"node {n}") for n, p in nodes.items()]
    if rank in ranks:
        return [LogFile(ranks[rank], f"rank {rank}")]
    return [LogFile(p, f"node {n}", rank=rank) for n, p in nodes.items()]


def _locate(
    job_id: str, record: JobRecord | None, runner: Runner
) -> tuple[Path, str, str | None, str]:
    """(log directory, file stem, backend, how it was found) of a job's output files.

    The stem holds a glob for the job name when only the directory is known.
    """
    if record is not None:
        stem = job_id if record.via == "submitit" else f"{record.name}-{job_id}"
        return Path(record.log_dir), stem, record.via, f"job record {record_path(job_id)}"
    source = f"no job record {record_path(job_id)}"
    out = _slurm_output(job_id, runner)
    if out is None:
        guess = Path.cwd() / "ddpkit-logs"
        return guess, f"*-{job_id}", None, f"{source}, SLURM does not know the job"
    source += ", batch output path from scontrol"
    if out.name.startswith(f"{job_id}_"):  # submitit: <folder>/<id>_0_log.out
        return out.parent, job_id, "submitit", source
    # ddpkit's templates: <log_dir>/<name>-<id>.out
    return out.parent, out.name.removesuffix(".out"), "sbatch", source


def _slurm_output(job_id: str, runner: Runner) -> Path | None:
    """The batch output file SLURM shows for the job, while the controller remembers it (None
    without SLURM at all: the caller says where it looked instead)."""
    stdout = (job_fields(job_id, runner=runner) or {}).get("StdOut")
    return Path(stdout) if stdout else None


def _numbered(directory: Path, prefix: str, suffix: str) -> dict[int, Path]:
    """``{N: path}`` for the files ``<prefix>N<suffix>`` in ``directory``, ordered by N."""
    marker = prefix.rsplit("*", 1)[-1]  # the prefix may start with a glob for the job name
    found: dict[int, Path] = {}
    for path in directory.glob(f"{prefix}*{suffix}"):
        number = path.name.removesuffix(suffix).rsplit(marker, 1)[-1]
        if number.isdigit():
            found[int(number)] = path
    return dict(sorted(found.items()))


def read_text(path: Path) -> str:
    """The whole file ("" when it does not exist yet)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def read_new(
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
