"""Where a job's output is, and reading it: one ``LogFile`` per file, whatever the backend.

Backends say which files a job has (``Backend.log_files``); this module holds the view they
return (:class:`LogFile`, with its per-rank filter), the lookup of the files of a job that ran
on SLURM through ddpkit's templates or submitit (:func:`slurm_log_files`), and the readers that
``ddpkit logs`` (``--follow``) uses. It imports no backend, so every backend can import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ddpkit.jobs import slurm
from ddpkit.jobs.records import JobRecord, record_path
from ddpkit.jobs.slurm import SlurmError

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
    job_id: str, record: JobRecord | None, rank: int | None = None
) -> tuple[list[LogFile], str]:
    """The output files of a SLURM job that exist, and a description of where they were looked for.

    Without ``rank``: the batch output, then every rank's file (srun, submitit) or node file
    (torchrun). With ``rank``: that rank's own file, or the node files filtered to its
    ``[rankN]: `` lines. The place comes from the job record, else from SLURM (the batch
    output path), else ``./ddpkit-logs``.
    """
    directory, stem, via, source = _locate(job_id, record)
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


def _locate(job_id: str, record: JobRecord | None) -> tuple[Path, str, str | None, str]:
    """(log directory, file stem, backend, how it was found) of a job's output files.

    The stem holds a glob for the job name when only the directory is known.
    """
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
