"""The job-script contract: the ``DDPKIT_*`` variables a job script hands to the running job.

Every way ddpkit starts a job (the sbatch templates, submitit, torchx) exports the same
variables, computed by :func:`exports` from the spec, and the code inside the job
(:mod:`ddpkit.cluster` detection, :mod:`ddpkit.worker`) reads them by the names below. A spec
may not set them in ``env`` (:data:`RESERVED_ENV`, derived from the table): each has a field of
its own, or is the script's to set.

    variable                     from the spec          read by
    DDPKIT_EXPECTED_WORLD_SIZE   nodes x procs          detection: a world of one in a job of
                                                        several processes is an error, not a run
    DDPKIT_HOST_TEMPLATE         host_template          detection: the master's host name
    DDPKIT_JOB_LAUNCH            launch                 detection: torchrun inside srun tasks
    DDPKIT_SIGNAL                signal                 the stop-signal latch and the guard
    DDPKIT_MAX_REQUEUES          max_requeues           the guard's requeue cap
    DDPKIT_LATCH_DIR             (the batch script)     the latch: its marker, so that the
                                                        batch shell passes a held signal on
    DDPKIT_SWEEP_TASK            sweep (array index)    the training script: which run it is
    DDPKIT_SWEEP_RUN             sweep (the run name)   the training script: its run's folder
    DDPKIT_SWEEP_<NAME>          sweep (each value)     the training script: its values

The sweep variables differ per array task: the batch script picks them from a table written
into it by ``SLURM_ARRAY_TASK_ID`` (:func:`sweep_exports` computes one task's); no ``env`` key
of a spec may start with ``DDPKIT_SWEEP_``.

Importing this module imports nothing but the standard library: the readers live below
``jobs/`` in the layering and must stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddpkit.jobs.sweep import RUN_VAR, SWEEP_VAR_PREFIX, TASK_VAR, SweepTask, value_var

if TYPE_CHECKING:
    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "CONTRACT",
    "EXPECTED_WORLD_SIZE_VAR",
    "HOST_TEMPLATE_VAR",
    "JOB_LAUNCH_VAR",
    "LATCH_DIR_VAR",
    "MAX_REQUEUES_VAR",
    "RESERVED_ENV",
    "SIGNAL_VAR",
    "SUBMITIT_SIGNAL_VAR",
    "SWEEP_RUN_VAR",
    "SWEEP_TASK_VAR",
    "SWEEP_VAR_PREFIX",
    "Variable",
    "exports",
    "reserved_env_hint",
    "sweep_exports",
]

EXPECTED_WORLD_SIZE_VAR = "DDPKIT_EXPECTED_WORLD_SIZE"
JOB_LAUNCH_VAR = "DDPKIT_JOB_LAUNCH"
HOST_TEMPLATE_VAR = "DDPKIT_HOST_TEMPLATE"
SIGNAL_VAR = "DDPKIT_SIGNAL"
MAX_REQUEUES_VAR = "DDPKIT_MAX_REQUEUES"
LATCH_DIR_VAR = "DDPKIT_LATCH_DIR"
# not ddpkit's: which signal submitit's job side binds (its own handler, replaced by ddpkit's)
SUBMITIT_SIGNAL_VAR = "SUBMITIT_PREEMPT_SIGNAL"
SWEEP_TASK_VAR = TASK_VAR
SWEEP_RUN_VAR = RUN_VAR


@dataclass(frozen=True)
class Variable:
    """One variable of the contract: its name and, for a spec's ``env``, the way to set it."""

    name: str
    instead: str  # the hint when a spec's env sets it


CONTRACT: tuple[Variable, ...] = (
    Variable(EXPECTED_WORLD_SIZE_VAR, "the job script sets it from nodes x procs_per_node"),
    Variable(HOST_TEMPLATE_VAR, "set host_template instead"),
    Variable(JOB_LAUNCH_VAR, "the job script sets it from launch"),
    Variable(SIGNAL_VAR, "set signal instead"),
    Variable(MAX_REQUEUES_VAR, "set max_requeues instead"),
    Variable(LATCH_DIR_VAR, "the batch script makes it for the stop signal's hold"),
    Variable(SWEEP_TASK_VAR, "the batch script sets it from SLURM_ARRAY_TASK_ID"),
    Variable(SWEEP_RUN_VAR, "the batch script sets it from the task's values"),
)

# Set by the job script itself; a spec value would silently fight it.
RESERVED_ENV: dict[str, str] = {variable.name: variable.instead for variable in CONTRACT}
_SWEEP_HINT = "declare the parameter under sweep: instead; every rank gets DDPKIT_SWEEP_<NAME>"


def reserved_env_hint(key: str) -> str | None:
    """Why a spec's ``env`` may not set ``key`` (the contract's, or the sweep's prefix), or None."""
    if key in RESERVED_ENV:
        return RESERVED_ENV[key]
    return _SWEEP_HINT if key.startswith(SWEEP_VAR_PREFIX) else None


def sweep_exports(task: SweepTask) -> dict[str, str]:
    """One sweep task's variables: its index, its run name, then each value (spec order)."""
    values = {SWEEP_TASK_VAR: str(task.index), SWEEP_RUN_VAR: task.run}
    return values | {value_var(name): value for name, value in task.values.items()}


def exports(spec: JobSpec, *, launch: str | None = None) -> dict[str, str]:
    """The contract's variables for ``spec``, in the table's order (the latch folder is made by
    the batch script at run time, so it is not here). ``launch`` overrides the spec's launch
    mode for a backend that starts processes its own way (submitit: one task per process,
    torchx: ``ddpkit run`` per node)."""
    values = {EXPECTED_WORLD_SIZE_VAR: str(spec.world_size)}
    if spec.host_template is not None:
        values[HOST_TEMPLATE_VAR] = spec.host_template
    values[JOB_LAUNCH_VAR] = launch or spec.launch
    if spec.signal is not None:
        values[SIGNAL_VAR] = spec.signal
    values[MAX_REQUEUES_VAR] = str(spec.max_requeues)
    return values
