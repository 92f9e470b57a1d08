"""The job-script contract's values for a spec: what every way ddpkit starts a job exports.

The sbatch templates, submitit and torchx hand the job the same ``DDPKIT_*`` variables; their
names are :mod:`ddpkit.contract`'s. A sweep's differ per array task (:func:`sweep_exports`).
"""

from __future__ import annotations

from ddpkit.contract import (
    EXPECTED_WORLD_SIZE_VAR,
    HANG_FIRST_TIMEOUT_VAR,
    HANG_TIMEOUT_VAR,
    HOST_TEMPLATE_VAR,
    JOB_LAUNCH_VAR,
    LOG_DIR_VAR,
    MAX_REQUEUES_VAR,
    SIGNAL_VAR,
    SWEEP_RUN_VAR,
    SWEEP_TASK_VAR,
)
from ddpkit.jobs.spec import JobSpec
from ddpkit.jobs.sweep import SweepTask, value_var

__all__ = ["exports", "sweep_exports"]


def sweep_exports(task: SweepTask) -> dict[str, str]:
    """One sweep task's variables: its index, its run name, then each value (spec order)."""
    values = {SWEEP_TASK_VAR: str(task.index), SWEEP_RUN_VAR: task.run}
    return values | {value_var(name): value for name, value in task.values.items()}


def exports(spec: JobSpec, *, launch: str | None = None) -> dict[str, str]:
    """The contract's variables for ``spec``, in the table's order; ``launch`` overrides the
    spec's for a backend that starts processes its own way (submitit, torchx). Under
    ``nodes: MIN-MAX`` the world size is the sbatch script's to compute (:mod:`ddpkit.jobs.render`);
    the other backends refuse a range."""
    values = {} if spec.min_nodes is not None else {EXPECTED_WORLD_SIZE_VAR: str(spec.world_size)}
    if spec.host_template is not None:
        values[HOST_TEMPLATE_VAR] = spec.host_template
    values[JOB_LAUNCH_VAR] = launch or spec.launch
    if spec.signal is not None:
        values[SIGNAL_VAR] = spec.signal
    values[MAX_REQUEUES_VAR] = str(spec.max_requeues)
    values[LOG_DIR_VAR] = spec.log_path
    if spec.hang_timeout_s is not None:
        values[HANG_TIMEOUT_VAR] = f"{spec.hang_timeout_s:g}"
    if spec.hang_first_timeout_s is not None:
        values[HANG_FIRST_TIMEOUT_VAR] = f"{spec.hang_first_timeout_s:g}"
    return values
