"""Job records: what ddpkit remembers about a job it submitted, one JSON file per job.

Written once, atomically, after a successful submission to ``$DDPKIT_HOME/jobs/<job id>.json``:
what SLURM forgets soon (without accounting, minutes after the job ends) and
``status``/``logs``/``cancel`` need; without a record they ask SLURM alone.

torchx's app handle is kept in ``handle``; a slurm handle shares its SLURM job id's file, other
schedulers' get ``<scheduler>-<app id>.json`` (:func:`record_key`). A job run in the foreground
(torchx's local_cwd) is rewritten once with its ``final_state``. Fields added later
(``run_id``, ``min_nodes``) read as None from older records.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from ddpkit.cluster.runid import check_run_id
from ddpkit.cluster.slurmtools import parse_job_id
from ddpkit.contract import DEFAULT_HOME, HOME_VAR, RUN_ID_VAR
from ddpkit.errors import ConfigError

if TYPE_CHECKING:
    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "JobRecord",
    "Via",
    "ddpkit_home",
    "is_torchx_handle",
    "load_record",
    "new_record",
    "parse_job",
    "record_key",
    "record_path",
    "recorded_run_id",
    "save_record",
    "split_handle",
    "submitted_run_id",
]

Via = Literal["sbatch", "submitit", "torchx"]

# A torchx app handle as ddpkit accepts it: <scheduler>://<session>/<app id>. Stricter than torchx's
# own parser (any characters): the app id becomes part of a file name, so no '/' and no leading '.'.
_HANDLE = re.compile(r"([a-z][a-z0-9_]*)://([A-Za-z0-9_.-]+)/([A-Za-z0-9_-][A-Za-z0-9_.-]*)")


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
    handle: str | None = None  # the backend's own name of the job (torchx's app handle)
    final_state: str | None = None  # a job run in the foreground: the backend's final state
    # a sweep (job array): each task's run name, by task index; the job id is the array's
    sweep_runs: tuple[str, ...] | None = None
    run_id: str | None = None  # the ranks' run id as the submission knew it (submitted_run_id)
    min_nodes: int | None = None  # nodes: MIN-MAX: MIN (``nodes`` is MAX); None: a fixed count

    @property
    def name_for_user(self) -> str:
        """What `ddpkit submit` prints and the other commands take: the handle, else the id."""
        return self.handle or self.job_id


# Keys of records written before the fields were named for every backend.
_RENAMED = {"torchx_handle": "handle", "torchx_state": "final_state"}


def new_record(
    spec: JobSpec,
    job_id: str,
    via: Via,
    script: str | None,
    *,
    launch: str | None = None,
    env: Mapping[str, str] | None = None,
) -> JobRecord:
    """The record of ``spec`` just submitted to SLURM as ``job_id`` (``launch``: the spec's,
    unless the backend starts processes its own way; ``env``: the submitting environment,
    default ``os.environ``, read only)."""
    return JobRecord(
        job_id=job_id,
        via=via,
        name=spec.name,
        log_dir=spec.log_path,
        launch=launch or spec.launch,
        nodes=spec.nodes,
        min_nodes=spec.min_nodes,
        procs_per_node=spec.procs,
        workdir=spec.workdir,
        script=script,
        submitted_at=time.time(),
        sweep_runs=None if spec.sweep is None else tuple(task.run for task in spec.sweep.tasks),
        run_id=submitted_run_id(
            spec.env, job_id, os.environ if env is None else env, array=spec.sweep is not None
        ),
    )


def submitted_run_id(
    spec_env: Mapping[str, str],
    slurm_job: str | None,
    env: Mapping[str, str],
    *,
    array: bool = False,
) -> str | None:
    """The run id the ranks of a job will have, by :mod:`ddpkit.cluster.runid`'s steps 1 and
    2: ``DDPKIT_RUN_ID`` from the spec's ``env`` (``spec_env``), else from ``env`` (the
    submitting environment, which the job inherits), else ``slurm-<slurm_job>``. None when that
    is not one id: a job ``array`` (each task its own), no SLURM job (``slurm_job`` None), or a
    ``DDPKIT_RUN_ID`` that is no usable run id (the job's ranks will refuse it)."""
    named = spec_env.get(RUN_ID_VAR) or env.get(RUN_ID_VAR)
    if named:
        try:
            return check_run_id(named)
        except ConfigError:
            return None
    if slurm_job is None or array:
        return None
    return f"slurm-{slurm_job}"


def recorded_run_id(record: JobRecord | None, job: str) -> str | None:
    """The run id of ``job`` (a job id, a sweep task ``123_4``, a handle) by its record: the
    recorded one, else for a task of a sweep submitted to SLURM ``slurm-<task>``; None without
    a record or when the record does not know it (one written before run ids were kept)."""
    if record is None:
        return None
    if record.run_id is not None:
        return record.run_id
    base, sep, task = job.partition("_")
    if record.sweep_runs is not None and record.handle is None and sep and task.isdigit():
        return f"slurm-{base}_{task}"
    return None


def ddpkit_home(env: Mapping[str, str] | None = None) -> Path:
    """``$DDPKIT_HOME`` from ``env`` (default ``os.environ``, read only), else ~/.cache/ddpkit."""
    source = os.environ if env is None else env
    return Path(source.get(HOME_VAR, "") or DEFAULT_HOME).expanduser()


def is_torchx_handle(job: str) -> bool:
    """Whether ``job`` looks like a torchx app handle (``scheduler://session/app_id``)."""
    return "://" in job


def parse_job(job: str) -> str:
    """A SLURM job id (see ``parse_job_id``) or a torchx app handle, checked; else ConfigError."""
    text = job.strip()
    if not is_torchx_handle(text):
        return parse_job_id(text)
    if _HANDLE.fullmatch(text) is None:
        raise ConfigError(
            f"job={job!r} is not a torchx app handle ddpkit can follow",
            hint="use the handle `ddpkit submit --via torchx` printed, like slurm://torchx/1234",
        )
    return text


def split_handle(handle: str) -> tuple[str, str]:
    """``(scheduler, app id)`` of a torchx app handle (checked by :func:`parse_job`)."""
    scheduler, _, rest = parse_job(handle).partition("://")
    return scheduler, rest.rpartition("/")[2]


def record_key(job: str) -> str:
    """The file stem of ``job``'s record: the SLURM job id (slurm handles included), else
    ``<scheduler>-<app id>`` for another scheduler's handle."""
    text = parse_job(job)
    match = _HANDLE.fullmatch(text)
    if match is None:
        return text
    scheduler, _, app_id = match.groups()
    return parse_job_id(app_id) if scheduler == "slurm" else f"{scheduler}-{app_id}"


def record_path(job_id: str, *, home: Path | None = None) -> Path:
    """Where the record of ``job_id`` (a SLURM job id or torchx app handle) lives."""
    # record_key admits no '/' and no leading '.': the path stays inside the jobs folder
    return (ddpkit_home() if home is None else home) / "jobs" / f"{record_key(job_id)}.json"


def save_record(record: JobRecord, *, home: Path | None = None) -> Path:
    """Write ``record`` atomically and return its path."""
    path = record_path(record.name_for_user, home=home)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(asdict(record), indent=2, sort_keys=True) + "\n"
    # Same directory as the target: rename is atomic only within one file system.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_record(job_id: str, *, home: Path | None = None) -> JobRecord | None:
    """The record of ``job_id``, or None when ddpkit did not submit it (or it was removed).

    A task of a sweep (``123_4``) has no record of its own: the array's (``123``) answers.
    """
    found = _read_record(job_id, home)
    base, sep, task = job_id.partition("_")
    if found is None and sep and task.isdigit() and base.isdigit():
        array = _read_record(base, home)
        if array is not None and array.sweep_runs is not None:
            return array
    return found


def _read_record(job_id: str, home: Path | None) -> JobRecord | None:
    path = record_path(job_id, home=home)

    def damaged(problem: str) -> ConfigError:
        hint = "delete the file; status, logs and cancel then ask SLURM alone"
        return ConfigError(f"job record {str(path)!r} {problem}", hint=hint)

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: [[[[...
        reason = "nested too deep" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise damaged(f"cannot be read: {reason}") from None
    known = {f.name for f in fields(JobRecord)}
    required = {f.name for f in fields(JobRecord) if f.default is MISSING}
    if isinstance(data, dict):
        data = {_RENAMED.get(k, k): v for k, v in data.items()}
    if not isinstance(data, dict) or not required <= set(data):
        raise damaged("is not a ddpkit job record")
    data = {key: value for key, value in data.items() if key in known}
    bad = next((key for key, value in data.items() if not _RECORD_TYPES[key](value)), None)
    if bad is not None:
        raise damaged(f"has {bad}={repr(data[bad])[:80]}, which ddpkit never writes")
    if isinstance(data.get("sweep_runs"), list):  # JSON has no tuples
        data["sweep_runs"] = tuple(data["sweep_runs"])
    return JobRecord(**data)


# What a field holds as JSON, by its annotation (a record is ddpkit's file, but folders get
# shared and files damaged: a wrong type made a traceback far from the file).
_JSON_TYPES: dict[str, Callable[[object], bool]] = {
    "str": lambda value: isinstance(value, str),
    "str | None": lambda value: value is None or isinstance(value, str),
    "Via": lambda value: value in get_args(Via),
    "int": lambda value: type(value) is int and value >= 0,  # not bool, which is an int too
    "int | None": lambda value: value is None or (type(value) is int and value >= 1),
    "float": lambda value: type(value) in (int, float),
    "tuple[str, ...] | None": lambda value: (
        value is None or (isinstance(value, list) and all(isinstance(run, str) for run in value))
    ),
}
_RECORD_TYPES = {f.name: _JSON_TYPES[str(f.type)] for f in fields(JobRecord)}
