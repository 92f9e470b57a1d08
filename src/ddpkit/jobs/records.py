"""Job records: what ddpkit remembers about a job it submitted, one JSON file per job.

A record is written once, after a successful submission, to
``$DDPKIT_HOME/jobs/<job id>.json`` (``DDPKIT_HOME`` defaults to ``~/.cache/ddpkit``). It holds
what SLURM does not keep for long (without accounting a finished job is forgotten after a few
minutes): the backend, the job name, the absolute log directory, the launch mode and layout, and
the submitted script (or the submitit folder). ``status``/``logs``/``cancel`` use it when it is
there and fall back to SLURM when it is not. Writes are atomic (temporary file + rename), so a
reader never sees half a record.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

from ddpkit.errors import ConfigError
from ddpkit.jobs.slurm import parse_job_id

__all__ = [
    "JobRecord",
    "Via",
    "ddpkit_home",
    "load_record",
    "record_path",
    "save_record",
]

Via = Literal["sbatch", "submitit"]


@dataclass(frozen=True)
class JobRecord:
    """A submitted job as ddpkit saw it at submission time."""

    job_id: str
    via: Via
    name: str
    log_dir: str  # absolute; for submitit this is the executor folder
    launch: str  # "srun" or "torchrun" ("srun" for submitit: one task per process)
    nodes: int
    procs_per_node: int
    workdir: str
    script: str | None = None  # the sbatch text that was submitted (as submitit wrote it)
    submitted_at: float = 0.0  # time.time() of the submission


def ddpkit_home(env: Mapping[str, str] | None = None) -> Path:
    """``$DDPKIT_HOME`` from ``env`` (default ``os.environ``, read only), else ~/.cache/ddpkit."""
    source = os.environ if env is None else env
    configured = source.get("DDPKIT_HOME", "")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "ddpkit"


def record_path(job_id: str, *, home: Path | None = None) -> Path:
    """Where the record of ``job_id`` lives (whether or not it exists)."""
    # parse_job_id admits digits, '_' and '+' only: the path stays inside the jobs folder
    return (ddpkit_home() if home is None else home) / "jobs" / f"{parse_job_id(job_id)}.json"


def save_record(record: JobRecord, *, home: Path | None = None) -> Path:
    """Write ``record`` atomically and return its path."""
    path = record_path(record.job_id, home=home)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(asdict(record), indent=2, sort_keys=True) + "\n"
    # Same directory as the target: rename is atomic only within one file system.
    fd, tmp = tempfile.mkstemp(prefix=f".{record.job_id}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_record(job_id: str, *, home: Path | None = None) -> JobRecord | None:
    """The record of ``job_id``, or None when ddpkit did not submit it (or it was removed)."""
    path = record_path(job_id, home=home)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"job record {str(path)!r} cannot be read: {exc}",
            hint="delete the file; status, logs and cancel then ask SLURM alone",
        ) from exc
    known = {f.name for f in fields(JobRecord)}
    if not isinstance(data, dict) or not {"job_id", "via", "name", "log_dir"} <= set(data):
        raise ConfigError(
            f"job record {str(path)!r} is not a ddpkit job record",
            hint="delete the file; status, logs and cancel then ask SLURM alone",
        )
    return JobRecord(**{k: v for k, v in data.items() if k in known})
