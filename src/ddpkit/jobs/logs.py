"""A job's output files, whatever the backend: one ``LogFile`` per file, and reading them.

Each backend owns its log layout (``Backend.log_files``); this module holds what the layouts
share and the readers ``ddpkit logs`` uses. It imports no backend, so every backend can use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ddpkit.cluster.slurmtools.query import job_fields
from ddpkit.cluster.slurmtools.runner import Runner, subprocess_runner
from ddpkit.jobs.records import JobRecord, record_path

__all__ = [
    "JobLogs",
    "LogFile",
    "numbered",
    "pick",
    "read_new",
    "read_text",
    "slurm_stdout",
    "sweep_log_files",
]


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


def slurm_stdout(job_id: str, runner: Runner = subprocess_runner) -> Path | None:
    """The batch output file SLURM shows for the job, while the controller remembers it (None
    without SLURM at all: the caller says where it looked instead)."""
    stdout = (job_fields(job_id, runner=runner) or {}).get("StdOut")
    return Path(stdout) if stdout else None


def sweep_log_files(
    job_id: str,
    record: JobRecord,
    rank: int | None,
    task_files: Callable[[Path, str, int, str], list[LogFile]],
    pattern: str,
) -> tuple[list[LogFile], str]:
    """A sweep's files: every task's for its array (``123``), labelled ``task 3 rank 1``; one
    task's (``123_3``) only. ``task_files(directory, array, task, run)`` is the backend's
    layout of one task's files; ``pattern`` describes it for "looked in"."""
    runs = record.sweep_runs or ()
    array, _, task = job_id.partition("_")
    indices = [int(task)] if task.isdigit() else list(range(len(runs)))
    directory = Path(record.log_dir)
    files = []
    for index in indices:
        if index >= len(runs):
            continue
        label = f"task {index} " if not task else ""
        found = task_files(directory, array, index, runs[index])
        files += [replace(file, label=label + file.label) for file in found]
    return files, f"{pattern} (job record {record_path(array)})"


def numbered(directory: Path, prefix: str, suffix: str) -> dict[int, Path]:
    """``{N: path}`` for the files ``<prefix>N<suffix>`` in ``directory``, ordered by N."""
    marker = prefix.rsplit("*", 1)[-1]  # the prefix may start with a glob for the job name
    found: dict[int, Path] = {}
    for path in directory.glob(f"{prefix}*{suffix}"):
        number = path.name.removesuffix(suffix).rsplit(marker, 1)[-1]
        if number.isascii() and number.isdigit():  # a planted "77_²_log.out" is not a rank's
            found[int(number)] = path
    return dict(sorted(found.items()))


def pick(
    rank: int | None, batch: list[LogFile], ranks: dict[int, Path], nodes: dict[int, Path]
) -> list[LogFile]:
    """Without ``rank``: the batch output, every rank's file, every node's file. With it: that
    rank's own file, or the node files filtered to its ``[rankN]: `` lines."""
    if rank is None:
        files = [*batch, *(LogFile(p, f"rank {n}") for n, p in ranks.items())]
        return files + [LogFile(p, f"node {n}") for n, p in nodes.items()]
    if rank in ranks:
        return [LogFile(ranks[rank], f"rank {rank}")]
    return [LogFile(p, f"node {n}", rank=rank) for n, p in nodes.items()]


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
