"""One protocol for every way ddpkit submits a job, and the registry that finds them.

As torchx's ``Scheduler``: a backend turns a spec into a printable :class:`Request` without
side effects (``dry_run``), submits exactly that request (``schedule``), and follows what it
submitted (``status``, ``sweep_status``, ``cancel``, ``log_files``: it owns its log layout).
Nothing outside this package branches on a backend's name (tests/test_backend_names.py checks).
A backend's module is imported on first use (submitit and torchx are optional extras); a fourth
backend is one module with a ``BACKEND`` object and one line in :data:`BACKENDS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ddpkit.errors import ConfigError
from ddpkit.hints import did_you_mean
from ddpkit.jobs.records import JobRecord, Via, is_torchx_handle

if TYPE_CHECKING:
    from ddpkit.cluster.slurmtools import JobStatus
    from ddpkit.jobs.logs import LogFile
    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "BACKENDS",
    "SCHEDULERS",
    "Backend",
    "Request",
    "SweepTask",
    "check_scheduler",
    "follower",
    "get_backend",
    "refuse_sbatch_only",
]

# backend name -> the module whose BACKEND implements it (imported on first use)
BACKENDS: dict[Via, str] = {
    "sbatch": "ddpkit.jobs.backends.sbatch",
    "submitit": "ddpkit.jobs.backends.submitit",
    "torchx": "ddpkit.jobs.backends.torchx",
}


@dataclass(frozen=True)
class Request:
    """What a submission hands over, before anything is submitted; ``str()`` prints it.

    ``text`` is the dry run, byte for byte; ``payload`` the backend's own object for
    ``schedule``, so what is scheduled is what was shown. ``notes``: what the user should hear
    on submitting it. ``foreground``: ``schedule`` runs the job until it ends (a local torchx
    app) and cancels it on a stop signal, which others hold (:mod:`ddpkit.jobs.interrupts`).
    """

    via: Via
    spec: JobSpec
    text: str
    scheduler: str | None = None
    payload: Any = None
    notes: tuple[str, ...] = ()
    foreground: bool = False

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class SweepTask:
    """One task of a sweep as ``ddpkit status ARRAY`` shows it: its job id (``123_4``), state,
    run name (from its values), the run id its ranks have (None when the record does not say)
    and its attempt (SLURM's requeue count of the task; None once the controller forgot it)."""

    task: str
    status: JobStatus
    run: str
    run_id: str | None
    attempt: int | None


class Backend(Protocol):
    """A way to run a job spec; every method but ``dry_run`` talks to a scheduler."""

    via: Via

    def dry_run(self, spec: JobSpec, scheduler: str | None = None) -> Request:
        """The request a submission would hand over; no side effects."""
        ...

    def schedule(self, request: Request) -> JobRecord:
        """Submit ``request`` (from this backend's ``dry_run``); the job's record, not saved."""
        ...

    def status(self, job_id: str, record: JobRecord | None) -> JobStatus:
        """The job's state; ``record`` is None for a job ddpkit did not submit."""
        ...

    def cancel(self, job_id: str, record: JobRecord | None) -> None:
        """Stop the job (every step and process of it)."""
        ...

    def sweep_status(self, job_id: str, record: JobRecord | None) -> list[SweepTask] | None:
        """Every task of a recorded sweep, in task order; None when ``job_id`` is not a
        sweep's (or the backend has no sweeps)."""
        ...

    def log_files(
        self, job_id: str, record: JobRecord | None, rank: int | None
    ) -> tuple[list[LogFile], str]:
        """The job's output files that exist, and where they were looked for: the backend owns
        its log layout (file names, per-rank files, a sweep's tasks)."""
        ...


# backends that take a scheduler (``--scheduler``), and which
SCHEDULERS: dict[Via, tuple[str, ...]] = {"torchx": ("local_cwd", "slurm")}


def check_scheduler(via: str, scheduler: str | None, *, flags: bool = False) -> None:
    """A ConfigError when ``scheduler`` is given to a backend that takes none; ``flags``: word
    it as the CLI's ``--scheduler``/``--via``."""
    if scheduler is None or via in SCHEDULERS:
        return
    takers = ", ".join(SCHEDULERS)
    if flags:
        message = f"--scheduler {scheduler} is for --via {takers}, not --via {via}"
    else:
        message = f"scheduler={scheduler!r} is for via {takers!r}, not via {via!r}"
    raise ConfigError(message, hint=f"add --via {takers}, or drop --scheduler")


def refuse_sbatch_only(spec: JobSpec, via: Via, range_why: str, snapshot_why: str = "") -> None:
    """Refuse, before anything is submitted, what only ddpkit's sbatch scripts carry: a
    ``health_check`` (they run it), ``nodes: MIN-MAX`` (``range_why``: why ``via`` cannot) and
    ``snapshot: true`` (they run from the copy)."""
    if spec.health_check is not None:
        raise ConfigError(
            f"health_check={spec.health_check!r} runs only in ddpkit's sbatch scripts, not "
            f"through {via}",
            hint="submit with --via sbatch, or remove health_check",
        )
    if spec.min_nodes is not None:
        raise ConfigError(
            f"nodes={spec.node_range!r} (a range) cannot go through {via}, whose {range_why}",
            hint=f"submit it with --via sbatch, or set nodes: {spec.nodes}",
        )
    if spec.snapshot:
        raise ConfigError(
            "snapshot=true copies the files for ddpkit's sbatch scripts only, not through "
            f"{via}{snapshot_why}",
            hint="submit with --via sbatch, or set snapshot: false",
        )


def follower(job: str, record: JobRecord | None) -> Backend:
    """The backend that follows ``job``: its record's; without one, torchx for an app handle
    (``scheduler://session/app``) and the sbatch backend (SLURM's tools) for a job id."""
    if record is not None:
        return get_backend(record.via)
    return get_backend("torchx" if is_torchx_handle(job) else "sbatch")


def get_backend(via: str) -> Backend:
    """The backend called ``via``; a ConfigError with a hint for an unknown name."""
    module_name = BACKENDS.get(via)  # type: ignore[call-overload]
    if module_name is None:
        raise ConfigError(f"via {via!r} is not a backend", hint=did_you_mean(via, BACKENDS))
    backend: Backend = importlib.import_module(module_name).BACKEND
    return backend
