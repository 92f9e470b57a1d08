"""One protocol for every way ddpkit submits a job, and the registry that finds them.

In the spirit of torchx's ``Scheduler``: a backend turns a spec into a printable
:class:`Request` without side effects (``dry_run``), submits exactly that request
(``schedule``: so a submission is a dry run plus a schedule), and follows what it submitted
(``status``, ``cancel``, ``log_files``). The jobs API (:mod:`ddpkit.jobs.api`) only looks a
backend up and calls it; nothing outside a backend's module branches on its name.

    backend name   module                              submits with
    sbatch         ddpkit.jobs.sbatch_backend          sbatch, a script from ddpkit's templates
    submitit       ddpkit.jobs.submitit_backend        submitit's AutoExecutor (on SLURM)
    torchx         ddpkit.jobs.torchx_jobs             torchx's runner (local_cwd or slurm)

Modules are imported when their backend is first used (submitit and torchx are optional
extras). A fourth backend is one module with a ``BACKEND`` object and one line in
:data:`BACKENDS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ddpkit.errors import ConfigError
from ddpkit.hints import did_you_mean
from ddpkit.jobs.records import JobRecord, Via

if TYPE_CHECKING:
    from ddpkit.cluster.slurmtools import JobStatus
    from ddpkit.jobs.logs import LogFile
    from ddpkit.jobs.spec import JobSpec

__all__ = ["BACKENDS", "Backend", "Request", "get_backend"]

# backend name -> the module whose BACKEND implements it (imported on first use)
BACKENDS: dict[Via, str] = {
    "sbatch": "ddpkit.jobs.sbatch_backend",
    "submitit": "ddpkit.jobs.submitit_backend",
    "torchx": "ddpkit.jobs.torchx_jobs",
}


@dataclass(frozen=True)
class Request:
    """What a submission hands over, before anything is submitted; ``str()`` prints it.

    ``text`` is the dry run, byte for byte (the sbatch script, submitit's parameters and
    script, torchx's dry run); ``payload`` is the backend's own object for ``schedule`` (the
    script, torchx's dry-run info), so what is scheduled is what was shown.
    """

    via: Via
    spec: JobSpec
    text: str
    scheduler: str | None = None
    payload: Any = None

    def __str__(self) -> str:
        return self.text


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

    def log_files(
        self, job_id: str, record: JobRecord | None, rank: int | None
    ) -> tuple[list[LogFile], str]:
        """The job's output files that exist, and where they were looked for."""
        ...


def get_backend(via: str) -> Backend:
    """The backend called ``via``; a ConfigError with a hint for an unknown name."""
    module_name = BACKENDS.get(via)  # type: ignore[call-overload]
    if module_name is None:
        raise ConfigError(
            f"via {via!r} is not a backend",
            hint=did_you_mean(via, BACKENDS),
        )
    backend: Backend = importlib.import_module(module_name).BACKEND
    return backend
