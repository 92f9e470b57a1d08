"""The submitit backend: a JobSpec as ``submitit.AutoExecutor`` parameters, and submission.

One function translates spec -> executor parameters, so the dry run shows exactly what a
submission uses. The spec's command runs in every task under submitit's task runner
(``ddpkit.launch.submitit_task.RunCommand``), or any picklable Python function does. Every task
is one process (``nodes * procs`` SLURM tasks): ``ddpkit.init()`` finds its rank through
submitit's SLURM environment. submitit is optional, imported only when used.

Stop signals: submitit asks SLURM for the warning (``--signal``, from ``signal`` and
``warning_s``) and, in the job, binds it to a handler that on rank 0 requeues at once. A
function that creates ``ddpkit.preemption_guard()`` replaces that handler in its process; the
task runner holds the signal and passes it on to the command (:mod:`ddpkit.cluster.stop`).

A sweep is one ``map_array``: each task a ``RunCommand`` with its command (placeholders
substituted as words, no shell) and ``DDPKIT_SWEEP_*`` variables; ``slurm_array_parallelism``
is ``max_parallel``, else every run at once (submitit's default caps it at 256).

``#SBATCH`` values: submitit quotes them for bash, but sbatch's parser takes a backslash as an
escape even inside single quotes (``\\'`` could add an option), so every value goes with its
backslashes doubled (:func:`ddpkit.compat.submitit_sbatch_value`). ``env`` goes into the batch
script as quoted ``export`` lines, not a subprocess ``env=``, which would replace the whole
environment and lose the SLURM variables the ranks come from.
"""

from __future__ import annotations

import importlib
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import yaml

from ddpkit.compat import (
    submitit_sbatch_in_own_session,
    submitit_sbatch_text,
    submitit_sbatch_value,
)
from ddpkit.contract import SUBMITIT_SIGNAL_VAR, SUBMITIT_TASK_MODULE
from ddpkit.errors import ConfigError
from ddpkit.jobs.backends import Request, refuse_sbatch_only
from ddpkit.jobs.backends.sbatch import SlurmJobs, check_array_size, log_dir_made
from ddpkit.jobs.chain import resolve_after
from ddpkit.jobs.exports import exports as contract_exports
from ddpkit.jobs.exports import sweep_exports
from ddpkit.jobs.keyword_call import KeywordCall
from ddpkit.jobs.logs import LogFile, numbered, pick, sweep_log_files
from ddpkit.jobs.records import JobRecord, Via, new_record, submitted_run_id
from ddpkit.jobs.render import batch_output_path, task_python
from ddpkit.jobs.spec_bind import srun_binding
from ddpkit.jobs.spec_chain import dependency
from ddpkit.jobs.spec_container import apptainer_prefix, pyxis_options
from ddpkit.jobs.sweep import substitute

if TYPE_CHECKING:
    import submitit

    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "BACKEND",
    "SubmititBackend",
    "command_line",
    "executor_parameters",
    "import_submitit",
    "job_record",
    "make_executor",
    "map_function",
    "submitted_script",
    "sweep_record",
    "sweep_runs",
]

_INSTALL_HINT = "pip install ddpkit[submitit]"


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


def command_line(spec: JobSpec, values: Mapping[str, str] | None = None) -> list[str]:
    """What every task runs: the spec's python (the image's in a container), unbuffered, then
    its command (with a sweep task's placeholder ``values`` substituted, as words: no shell)."""
    words = spec.command if values is None else [substitute(w, values) for w in spec.command]
    return [task_python(spec), "-u", *words]


def submitit_python(spec: JobSpec) -> str:
    """submitit's ``python``, the shell text before ``-u -m submitit.core._submit`` on its srun
    line: under apptainer ``apptainer exec ... IMAGE`` and the image's python."""
    return shlex.join([*apptainer_prefix(spec.container), task_python(spec)])


def _setup_lines(spec: JobSpec) -> list[str]:
    """The spec's setup lines (verbatim shell), then its environment as quoted exports."""
    # The job contract, as the sbatch templates export it (every submitit task is one process,
    # as under launch: srun), and the signal submitit's own job side binds.
    exports = {**spec.env, **contract_exports(spec, launch="srun")}
    if spec.signal is not None:
        exports[SUBMITIT_SIGNAL_VAR] = spec.signal
    return [*spec.setup, *(f"export {k}={shlex.quote(v)}" for k, v in exports.items())]


def executor_parameters(spec: JobSpec) -> dict[str, Any]:
    """``AutoExecutor.update_parameters`` keyword arguments for ``spec``."""
    if spec.launch != "srun":
        raise ConfigError(
            f"launch={spec.launch!r} cannot go through submitit, which starts one SLURM task "
            "per process (as launch: srun does)",
            hint="submit it with --via sbatch, or set launch: srun",
        )
    # submitit writes --ntasks-per-node, with which SLURM starts a node range on MIN nodes
    why = "executor asks for tasks per node: SLURM would start every attempt on its MIN nodes"
    refuse_sbatch_only(spec, "submitit", why)
    # False means "leave the option out" for an #SBATCH switch; submitit would write "=False".
    extras: dict[str, Any] = {k: v for k, v in spec.sbatch.items() if v is not False}
    extras.setdefault("chdir", spec.workdir)
    if spec.signal is not None:
        # submitit writes --signal=USR2@90 itself; its additional parameters win. No "B:": the
        # signal goes to every process of the step, as submitit expects.
        extras["signal"] = f"{spec.signal}@{spec.warning_s}"
    if spec.max_requeues == 0:
        extras["no-requeue"] = True
    after = dependency(spec.after, spec.after_type, spec.singleton)  # names resolved by now
    if after is not None:
        extras["dependency"] = after
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
    binding = srun_binding(spec.cpu_bind, spec.gpu_bind) + pyxis_options(spec.container)
    if binding:  # submitit's srun line for the tasks
        params["slurm_srun_args"] = binding
    if spec.sweep is not None:
        params["slurm_array_parallelism"] = spec.sweep.max_parallel or spec.sweep.count
    if spec.gpus_per_node:
        params["gpus_per_node"] = spec.gpus_per_node
    if spec.mem_gb is not None:
        params["mem_gb"] = spec.mem_gb
    names = ("partition", "account", "qos", "constraint")
    slurm = {f"slurm_{key}": getattr(spec, key) for key in names}
    return params | {key: value for key, value in slurm.items() if value is not None}


def _sbatch_read_back(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with every text that submitit writes on an ``#SBATCH`` line made to reach
    sbatch as it is (:func:`ddpkit.compat.submitit_sbatch_value`); ``slurm_setup`` is bash."""
    out = {k: submitit_sbatch_value(v) if isinstance(v, str) else v for k, v in params.items()}
    extras = params["slurm_additional_parameters"]
    out["slurm_additional_parameters"] = {
        k: submitit_sbatch_value(v) if isinstance(v, str) else v for k, v in extras.items()
    }
    return out


def make_executor(spec: JobSpec) -> submitit.AutoExecutor:
    """A SLURM ``AutoExecutor`` configured from ``spec`` (needs ``srun`` on PATH)."""
    # The folder is in submitit's --output patterns, where SLURM turns %j off after a
    # backslash: refused, as for sbatch scripts (the error names workdir or log_dir).
    batch_output_path(spec)
    module = import_submitit()
    try:
        executor: submitit.AutoExecutor = module.AutoExecutor(
            folder=Path(spec.log_path), cluster="slurm", slurm_python=submitit_python(spec)
        )
    except RuntimeError as exc:  # SlurmExecutor refuses to exist without srun
        raise ConfigError(
            f"via 'submitit' cannot reach SLURM: {exc}",
            hint="run on a host with the SLURM client commands (srun, sbatch) on PATH",
        ) from exc
    spec = resolve_after(spec)  # submit_function / map_function come here without a dry run
    executor.update_parameters(**_sbatch_read_back(executor_parameters(spec)))
    submitit_sbatch_in_own_session(executor)  # Ctrl-C: ddpkit holds it until the job's record
    return executor


def run_command(command: list[str], *, cwd: str, env: dict[str, str] | None = None) -> Any:
    """The picklable task runner for ``command`` (``RunCommand`` of the module
    ``SUBMITIT_TASK_MODULE`` names: launch/, above jobs/, so not imported by name)."""
    return importlib.import_module(SUBMITIT_TASK_MODULE).RunCommand(command, cwd=cwd, env=env)


def sweep_runs(spec: JobSpec) -> list[Any]:
    """One task runner (:func:`run_command`) per task of the spec's sweep: its command and
    variables."""
    if spec.sweep is None:
        return []
    return [
        run_command(
            command_line(spec, task.placeholder_values()), cwd=spec.workdir, env=sweep_exports(task)
        )
        for task in spec.sweep.tasks
    ]


def _run(command: Callable[[], int]) -> int:
    """What each array task of a sweep calls (map_array passes one argument per task)."""
    return command()


def job_record(spec: JobSpec, job: submitit.Job[Any]) -> JobRecord:
    """The record of a plain job, the spec's command or a function (``submit_function``);
    launch "srun" whatever the spec's: submitit starts one task per process."""
    return new_record(spec, str(job.job_id), "submitit", submitted_script(job), launch="srun")


def sweep_record(spec: JobSpec, jobs: Sequence[submitit.Job[Any]]) -> JobRecord:
    """The record of a sweep that ``map_array`` submitted, from its tasks' jobs.

    submitit submits a ``map_array`` of one item as a plain job (``123``, not ``123_0``):
    SLURM has no array whose tasks ``ddpkit status``/``logs`` could list, so the record is a
    plain job's (the run still gets its values, through its command and variables).
    """
    array, _, task = str(jobs[0].job_id).partition("_")
    record = new_record(spec, array, "submitit", submitted_script(jobs[0]), launch="srun")
    if task:
        return record
    plain = submitted_run_id(spec.env, array, os.environ)  # SLURM's run id of a plain job
    return replace(record, sweep_runs=None, run_id=plain)


def map_function(fn: Callable[..., Any], *, spec: JobSpec) -> list[submitit.Job[Any]]:
    """Run ``fn(**values)`` for each task of the spec's sweep, as one array (``map_array``);
    the values are the task's text, as the command would get them."""
    if spec.sweep is None:
        raise ConfigError(
            f"spec {spec.name!r} has no sweep to map over",
            hint="add a sweep: section (or --sweep), or use submit_function",
        )
    check_array_size(spec)
    calls = [KeywordCall(fn, dict(task.values)) for task in spec.sweep.tasks]
    return list(make_executor(spec).map_array(KeywordCall.__call__, calls))


# Arrays submitted before KeywordCall moved out pickled it under this name: a requeued task
# still finds it here.
_Call = KeywordCall


def submitted_script(job: submitit.Job[Any]) -> str | None:
    """The sbatch text submitit wrote for ``job`` (None if it is gone)."""
    try:
        return job.paths.submission_file.read_text(encoding="utf-8")
    except OSError:
        return None


class SubmititBackend(SlurmJobs):
    """The ``submitit`` backend: the spec's command through submitit's ``AutoExecutor``."""

    via: Via = "submitit"

    def dry_run(self, spec: JobSpec, scheduler: str | None = None) -> Request:
        """The executor folder, parameters and command, plus the sbatch text submitit would
        write (its own renderer, reachable only where ``srun`` exists; elsewhere a comment
        says so)."""
        spec = resolve_after(spec)  # after: names -> job ids, before anything is shown
        import_submitit()
        shown: dict[str, Any] = {
            "folder": spec.log_path,  # the executor's folder
            "python": submitit_python(spec),
            "parameters": executor_parameters(spec),
            "command": command_line(spec),
            "cwd": spec.workdir,
        }
        if spec.sweep is not None:
            shown["map_array"] = [
                {"task": task.index, "command": command.command, "env": command.env}
                for task, command in zip(spec.sweep.tasks, sweep_runs(spec), strict=True)
            ]
        head = yaml.safe_dump(shown, sort_keys=False, default_flow_style=False)
        count = None if spec.sweep is None else spec.sweep.count
        try:
            script = submitit_sbatch_text(make_executor(spec), map_count=count)
            text = f"{head}# sbatch script submitit would write:\n{script.rstrip()}\n"
        except ConfigError as exc:
            text = f"{head}# sbatch script: not shown ({exc.message})\n"
        return Request(self.via, spec, text)

    def schedule(self, request: Request) -> JobRecord:
        """The spec's command (a sweep: one array through ``map_array``)."""
        spec = request.spec
        check_array_size(spec)
        with log_dir_made(spec):
            executor = make_executor(spec)
            if spec.sweep is not None:
                return sweep_record(spec, executor.map_array(_run, sweep_runs(spec)))
            job = executor.submit(run_command(command_line(spec), cwd=spec.workdir))
        return job_record(spec, job)

    def stem(self, job: str, record: JobRecord) -> str:
        """submitit names its files by the job id alone."""
        return job

    def files_at(
        self, directory: Path, job: str, rank: int | None, stem: str, source: str
    ) -> tuple[list[LogFile], str]:
        """submitit's layout: ``<folder>/<id>_<task>_log.out`` (``stem`` is the job id); task
        0's file is the batch output."""
        ranks = numbered(directory, f"{stem}_", "_log.out")
        return pick(rank, [], ranks, {}), f"{directory}/{stem}_<N>_log.out ({source})"

    def sweep_files(
        self, job: str, record: JobRecord, rank: int | None
    ) -> tuple[list[LogFile], str]:
        """A sweep through ``map_array``: ``<folder>/<array>_<task>_<rank>_log.out``."""

        def task_files(directory: Path, array: str, task: int, run: str) -> list[LogFile]:
            return pick(rank, [], numbered(directory, f"{array}_{task}_", "_log.out"), {})

        pattern = f"{record.log_dir}/{job.partition('_')[0]}_<task>_<N>_log.out"
        return sweep_log_files(job, record, rank, task_files, pattern)


BACKEND = SubmititBackend()
