"""The submitit backend: a JobSpec as ``submitit.AutoExecutor`` parameters, and submission.

This module owns the translation spec -> executor parameters (one function, so the dry run shows
exactly what a submission uses) and the two ways to submit: the spec's command, run in every
task by ``submitit.helpers.CommandFunction``, or any picklable Python function. submitit is an
optional dependency, imported only here and only when used; without it the error names the
extra to install.

Every task is one process (submitit starts ``nodes * procs`` SLURM tasks), so inside the job
``ddpkit.init()`` finds its rank through submitit's SLURM environment. The spec's ``env`` goes
into the batch script as quoted ``export`` lines (``slurm_setup``) rather than into
CommandFunction's ``env=``: that argument replaces the whole environment, and the tasks would
lose the SLURM variables they find their ranks from. The spec's ``template`` is for sbatch
scripts only: submitit writes its own.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import yaml

from ddpkit.cluster.validate import EXPECTED_WORLD_SIZE_VAR, JOB_LAUNCH_VAR
from ddpkit.errors import ConfigError

if TYPE_CHECKING:
    import submitit

    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "command_line",
    "dry_run",
    "executor_parameters",
    "folder",
    "import_submitit",
    "make_executor",
    "submit_command",
    "submit_function",
    "submitted_script",
]

_INSTALL_HINT = "pip install ddpkit[submitit]"
HOST_TEMPLATE_VAR = "DDPKIT_HOST_TEMPLATE"  # as ddpkit.jobs.render exports it


def import_submitit() -> ModuleType:
    """``import submitit``, or a ConfigError naming the extra to install."""
    try:
        import submitit
    except ImportError as exc:
        raise ConfigError(
            f"via 'submitit' needs the submitit package, which cannot be imported ({exc})",
            hint=f"{_INSTALL_HINT}, or submit with --via sbatch",
        ) from exc
    return submitit


def folder(spec: JobSpec) -> Path:
    """The executor folder: the spec's log_dir, made absolute against its workdir."""
    return Path(spec.log_path)


def command_line(spec: JobSpec) -> list[str]:
    """What every task runs: the spec's python, unbuffered, then its command."""
    return [spec.python, "-u", *spec.command]


def _setup_lines(spec: JobSpec) -> list[str]:
    """The spec's setup lines (verbatim shell), then its environment as quoted exports."""
    # What the sbatch templates export too: detect() checks the world it finds against it.
    # Every submitit task is one process, as under launch: srun.
    exports = {**spec.env, EXPECTED_WORLD_SIZE_VAR: str(spec.world_size), JOB_LAUNCH_VAR: "srun"}
    if spec.host_template:
        exports[HOST_TEMPLATE_VAR] = spec.host_template
    return [*spec.setup, *(f"export {k}={shlex.quote(v)}" for k, v in exports.items())]


def executor_parameters(spec: JobSpec) -> dict[str, Any]:
    """``AutoExecutor.update_parameters`` keyword arguments for ``spec``."""
    if spec.launch != "srun":
        raise ConfigError(
            f"launch={spec.launch!r} cannot go through submitit, which starts one SLURM task "
            "per process (as launch: srun does)",
            hint="submit it with --via sbatch, or set launch: srun",
        )
    # False means "leave the option out" for an #SBATCH switch; submitit would write "=False".
    extras: dict[str, Any] = {k: v for k, v in spec.sbatch.items() if v is not False}
    extras.setdefault("chdir", spec.workdir)
    params: dict[str, Any] = {
        "name": spec.name,
        "nodes": spec.nodes,
        "tasks_per_node": spec.procs,
        "cpus_per_task": spec.cpus_per_task,
        "timeout_min": spec.time_min,
        "stderr_to_stdout": True,  # one file per rank, as srun --output gives in sbatch mode
        "slurm_setup": _setup_lines(spec),
        "slurm_additional_parameters": extras,
    }
    if spec.gpus_per_node:
        params["gpus_per_node"] = spec.gpus_per_node
    if spec.mem_gb is not None:
        params["mem_gb"] = spec.mem_gb
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(spec, key)
        if value is not None:
            params[f"slurm_{key}"] = value
    return params


def make_executor(spec: JobSpec) -> submitit.AutoExecutor:
    """A SLURM ``AutoExecutor`` configured from ``spec`` (needs ``srun`` on PATH)."""
    module = import_submitit()
    try:
        executor: submitit.AutoExecutor = module.AutoExecutor(
            folder=folder(spec), cluster="slurm", slurm_python=shlex.quote(spec.python)
        )
    except RuntimeError as exc:  # SlurmExecutor refuses to exist without srun
        raise ConfigError(
            f"via 'submitit' cannot reach SLURM: {exc}",
            hint="run on a host with the SLURM client commands (srun, sbatch) on PATH",
        ) from exc
    executor.update_parameters(**executor_parameters(spec))
    return executor


def dry_run(spec: JobSpec) -> str:
    """The executor folder, parameters and command, plus the sbatch text submitit would write.

    Nothing is created: the sbatch text comes from submitit's own renderer, which is reachable
    only where ``srun`` exists; elsewhere a comment says so. Without submitit installed this
    fails as a submission would.
    """
    import_submitit()
    head = yaml.safe_dump(
        {
            "folder": str(folder(spec)),
            "python": spec.python,
            "parameters": executor_parameters(spec),
            "command": command_line(spec),
            "cwd": spec.workdir,
        },
        sort_keys=False,
        default_flow_style=False,
    )
    try:
        script = _sbatch_text(make_executor(spec))
    except ConfigError as exc:
        return f"{head}# sbatch script: not shown ({exc.message})\n"
    return f"{head}# sbatch script submitit would write:\n{script.rstrip()}\n"


def _sbatch_text(executor: submitit.AutoExecutor) -> str:
    # submitit keeps its renderer private; reach it without submitting anything.
    inner: Any = executor._executor
    text: str = inner._make_submission_file_text(inner._submitit_command_str, "dry-run")
    return text


def submit_command(spec: JobSpec) -> tuple[str, str | None]:
    """Submit the spec's command; return the job id and the sbatch text submitit wrote."""
    module = import_submitit()
    executor = make_executor(spec)
    task = module.helpers.CommandFunction(command_line(spec), cwd=spec.workdir, verbose=True)
    job = executor.submit(task)
    return str(job.job_id), submitted_script(job)


def submit_function(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, spec: JobSpec
) -> submitit.Job[Any]:
    """Submit ``fn(*args, **kwargs)`` to run in every task, with the spec's resources."""
    return make_executor(spec).submit(fn, *args, **kwargs)


def submitted_script(job: submitit.Job[Any]) -> str | None:
    """The sbatch text submitit wrote for ``job`` (None if it is gone)."""
    try:
        return job.paths.submission_file.read_text(encoding="utf-8")
    except OSError:
        return None
