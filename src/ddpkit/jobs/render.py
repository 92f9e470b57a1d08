"""Job specs to sbatch scripts: the template context, the quoting filters, the torchrun line.

Templates render in :mod:`ddpkit.jobs.sandbox`; their errors become a ``ConfigError`` naming
the file and line. Rendering is deterministic: the same spec gives the same text.

Quoting, as checked on SLURM 22.05.8:

* bash: every user value goes through ``q`` (``shlex.quote``); ``setup`` lines are verbatim.
* ``#SBATCH`` lines are read by sbatch's own directive parser, not bash: it rejects unquoted
  whitespace ("Invalid directive"), silently cuts the line at an unquoted ``#``, strips single
  and double quotes, and treats a backslash as an escape even inside single quotes, so
  ``shlex.quote`` is wrong there (``'a\\b'`` reaches SLURM as ``ab``). ``sbatch_q`` writes such
  values in double quotes with ``\\`` and ``"`` escaped; newlines cannot be expressed at all.
* ``--output`` file names (sbatch and srun): ``%%`` is a literal ``%``; a backslash anywhere
  in the name turns every pattern off (``%j`` stays literal) and is dropped, so it is refused.
"""

from __future__ import annotations

import math
import re
import shlex
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2

from ddpkit.cluster.stop.exclude import EXIT_REQUEUED
from ddpkit.contract import (
    CLI_MODULE,
    ENDPOINT_MODULE,
    EXCLUDE_MODULE,
    EXPECTED_WORLD_SIZE_VAR,
    HEALTH_MODULE,
    RESV_PORTS_MODULE,
    RUN_COMMAND,
    STOP_HOLD_MODULE,
    SWEEP_RUN_VAR,
    SWEEP_TASK_VAR,
)
from ddpkit.errors import ConfigError, DdpkitError
from ddpkit.jobs import sandbox
from ddpkit.jobs import sweep as sweeps
from ddpkit.jobs.exports import exports as contract_exports
from ddpkit.jobs.exports import sweep_exports
from ddpkit.jobs.spec_bind import numa_flag, srun_binding
from ddpkit.jobs.spec_chain import dependency, ranks_filter
from ddpkit.jobs.spec_checks import shown
from ddpkit.jobs.spec_container import apptainer_prefix, pyxis_options
from ddpkit.jobs.user_template import LAUNCH_TEMPLATE_NAME, check_user_template

if TYPE_CHECKING:
    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "BUILTIN_TEMPLATES",
    "ENDPOINT_EXPANSION",
    "JOB_ID_EXPANSION",
    "NUM_NODES_EXPANSION",
    "batch_output_path",
    "command_words",
    "endpoint_command",
    "render_sbatch",
    "sbatch_extras",
    "sbatch_options",
    "sbatch_quote",
    "shell_quote",
    "task_output_pattern",
    "template_context",
    "torchrun_command",
]

BUILTIN_TEMPLATES = {"srun": "srun.sh.j2", "torchrun": "torchrun.sh.j2"}
BASE_TEMPLATE = "base.sh.j2"
_BUILTIN_NAMES = frozenset({BASE_TEMPLATE, *BUILTIN_TEMPLATES.values()})


class _ShellExpansion(str):
    """Text the batch shell must expand (``"$endpoint"``); ``q`` writes it as it is.

    Only this module creates these, so no user value can pass unquoted through ``q``.
    """

    __slots__ = ()


ENDPOINT_EXPANSION: str = _ShellExpansion('"$endpoint"')
JOB_ID_EXPANSION: str = _ShellExpansion('"$SLURM_JOB_ID"')
# a spec with nodes: MIN-MAX: how many nodes this attempt got, as SLURM tells the batch shell
NUM_NODES_EXPANSION: str = _ShellExpansion('"$SLURM_JOB_NUM_NODES"')
_ARRAY_TASK_EXPANSION = '"$SLURM_ARRAY_JOB_ID"_"$SLURM_ARRAY_TASK_ID"'
_PLACEHOLDER_VARS = {
    sweeps.TASK_PLACEHOLDER: SWEEP_TASK_VAR,
    sweeps.RUN_PLACEHOLDER: SWEEP_RUN_VAR,
}

# What sbatch's directive parser reads back unchanged without any quoting.
_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_UNWRITABLE = ("\n", "\r", "\x00")
_SLURM_NAMES = ("partition", "account", "qos", "constraint")
# Extras that already say how many GPUs a node gets: then no --gpus-per-node is added.
_GPU_OPTIONS = ("gres", "gpus", "gpus-per-task")
HEALTH_STEP_MARGIN_S = 60  # srun's bound on the health step beyond the check's own


# ---- quoting -----------------------------------------------------------------------------


def shell_quote(value: object) -> str:
    """``value`` as one bash word (the template filter ``q``)."""
    if type(value) is _ShellExpansion:
        return str.__str__(value)
    text = str(value)
    if "\x00" in text:
        raise ConfigError(
            f"value {shown(text)} contains a NUL character",
            hint="bash cannot pass NUL bytes; remove it from the spec",
        )
    return shlex.quote(text)


def sbatch_quote(value: object) -> str:
    """``value`` as one word of an ``#SBATCH`` line (the template filter ``sbatch_q``)."""
    text = str(value)
    if any(char in text for char in _UNWRITABLE):
        raise ConfigError(
            f"#SBATCH value {shown(text)} contains a newline, carriage return or NUL",
            hint="an #SBATCH directive is one line; remove the line break from the spec",
        )
    if _SBATCH_PLAIN.fullmatch(text):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _pattern_literal(field: str, value: str) -> str:
    """``value`` inside a SLURM filename pattern, standing for itself."""
    if "\\" in value:
        raise ConfigError(
            f"{field}={shown(value)} contains a backslash",
            hint="SLURM turns off %j/%t/%n in a log path with a backslash in it; "
            "choose a path without one",
        )
    return value.replace("%", "%%")


# ---- the pieces of the script -----------------------------------------------------------------
# Values arrive validated by JobSpec (names, env keys, reserved options, one-line values,
# absolute workdir); what is checked here is what only the rendering knows about.


def _log_dir_pattern(spec: JobSpec) -> str:
    """The log directory inside a SLURM ``--output`` pattern."""
    # workdir and log_dir are checked apart so that the error names the field at fault.
    _pattern_literal("workdir", spec.workdir)
    _pattern_literal("log_dir", spec.log_dir)
    return _pattern_literal("log_dir", spec.log_path)


def _log_pattern(spec: JobSpec, suffix: str) -> str:
    """A SLURM ``--output`` pattern for a file ``<name>-<suffix>`` in the log directory."""
    return f"{_log_dir_pattern(spec)}/{spec.name}-{suffix}"


def batch_output_path(spec: JobSpec, job_id: str | None = None) -> str:
    """The batch script's output file: the SLURM pattern, or the real path for ``job_id``
    (a sweep's array task: ``123_4``). Its folder must exist before ``sbatch``: SLURM fails the
    job (JobLaunchFailure) when it cannot open the file."""
    pattern = _log_pattern(spec, "%A_%a.out" if spec.sweep is not None else "%j.out")
    if job_id is None:
        return pattern
    array, _, task = job_id.partition("_")
    values = {"%": "%", "j": job_id, "A": array, "a": task}
    # One pass, as SLURM reads it: "%%" is a "%", "%j" the job id ("%%j" is "%j").
    return re.sub("%([%jAa])", lambda m: values[m[1]], pattern)


def task_output_pattern(spec: JobSpec) -> str:
    """srun's ``--output``: a file per rank (srun mode) or per node (torchrun mode).

    In a sweep, each task's files go to its run's folder (``<log_dir>/<run>/``) and are named
    after the array task (``<name>-<array id>_<task>-rank%t.out``), which a requeue keeps.
    """
    suffix = "node%n.out" if spec.launch == "torchrun" else "rank%t.out"
    if spec.sweep is None:
        return _log_pattern(spec, f"%j-{suffix}")
    return _ShellExpansion(
        f'{shlex.quote(_log_dir_pattern(spec))}/"${SWEEP_RUN_VAR}"/{shlex.quote(spec.name + "-")}'
        f"{_ARRAY_TASK_EXPANSION}{shlex.quote('-' + suffix)}"
    )


def _sweep_word(word: str) -> str:
    """A command word of a sweep: its placeholders become the task's variables, expanded by
    the batch shell inside double quotes (one word, no globbing); the rest is quoted."""
    parts = sweeps.split_word(word)
    if all(name is None for _, name in parts):
        return "".join(literal for literal, _ in parts)  # "{{" is "{" in a sweep's command
    out = []
    for literal, name in parts:
        if literal:
            out.append(shlex.quote(literal))
        if name is not None:
            out.append(f'"${_PLACEHOLDER_VARS.get(name) or sweeps.value_var(name)}"')
    return _ShellExpansion("".join(out))


def command_words(spec: JobSpec) -> list[str]:
    """The spec's command as the batch script runs it: as written, or in a sweep with its
    placeholders turned into the array task's variables (``q`` writes those as they are)."""
    if spec.sweep is None:
        return list(spec.command)
    return [_sweep_word(word) for word in spec.command]


def _sweep_context(spec: JobSpec) -> dict[str, Any] | None:
    """The sweep's table for the template: one ``case`` arm per array task."""
    if spec.sweep is None:
        return None
    tasks = []
    for task in spec.sweep.tasks:
        values = sweep_exports(task)
        assign = " ".join(f"{key}={shell_quote(value)}" for key, value in values.items())
        tasks.append({"index": task.index, "run": task.run, "assign": assign})
    names = [SWEEP_TASK_VAR, SWEEP_RUN_VAR, *map(sweeps.value_var, spec.sweep.params)]
    return {"count": spec.sweep.count, "tasks": tasks, "variables": names}


def _mem(mem_gb: float) -> str:
    # SLURM's G is 1024 M; whole gigabytes stay readable, the rest is rounded up to a MiB.
    if float(mem_gb).is_integer():
        return f"{int(mem_gb)}G"
    return f"{math.ceil(mem_gb * 1024)}M"


def sbatch_extras(spec: JobSpec) -> dict[str, str | None]:
    """``sbatch:`` from the spec, sorted; true is a bare flag (None), false leaves it out."""
    kept = sorted((key, value) for key, value in spec.sbatch.items() if value is not False)
    return {key: None if value is True else str(value) for key, value in kept}


def sbatch_options(spec: JobSpec) -> list[tuple[str, str | None]]:
    """The ``#SBATCH --key=value`` options in order (value None: a bare ``--key`` flag).

    ``nodes: MIN-MAX`` gives ``--nodes=MIN-MAX`` without ``--ntasks-per-node``: with it sbatch
    counts MIN x that many tasks and SLURM starts the job on MIN nodes even when MAX are free
    (SLURM 22.05). The job asks for one SLURM task of all a node's CPUs per node instead, and
    the job step (``srun --ntasks-per-node``) lays the processes out."""
    ranged = spec.min_nodes is not None
    options: list[tuple[str, str | None]] = [
        ("job-name", spec.name),
        ("nodes", spec.node_range),
    ]
    if not ranged:
        options.append(("ntasks-per-node", str(spec.tasks_per_node)))
    cpus = spec.cpus_per_task * spec.procs if ranged else spec.cpus_per_slurm_task
    options.append(("cpus-per-task", str(cpus)))
    extras = list(sbatch_extras(spec).items())
    if spec.gpus_per_node > 0 and not any(key in _GPU_OPTIONS for key, _ in extras):
        options.append(("gpus-per-node", str(spec.gpus_per_node)))
    if spec.mem_gb is not None:
        options.append(("mem", _mem(spec.mem_gb)))
    options.append(("time", str(spec.time_min)))
    options += [(f, getattr(spec, f)) for f in _SLURM_NAMES if getattr(spec, f) is not None]
    options.append(("chdir", spec.workdir))
    options.append(("output", batch_output_path(spec)))
    if spec.signal is not None:
        # B: the batch shell gets it and passes it on to the job step (see the templates)
        options.append(("signal", f"B:{spec.signal}@{spec.warning_s}"))
    options.append(("requeue", None) if spec.max_requeues > 0 else ("no-requeue", None))
    if not any(key == "open-mode" for key, _ in extras):
        options.append(("open-mode", "append"))  # a requeued run adds to its logs
    if spec.sweep is not None:
        limit = spec.sweep.max_parallel
        options.append(("array", f"0-{spec.sweep.count - 1}" + (f"%{limit}" if limit else "")))
    after = dependency(spec.after, spec.after_type, spec.singleton)  # job ids by now
    if after is not None:
        options.append(("dependency", after))
    return options + extras


def _exports(spec: JobSpec) -> list[tuple[str, str]]:
    """``export`` lines: the spec's env (sorted), then the job contract's variables
    (:mod:`ddpkit.jobs.exports`), which JobSpec refuses in env, so they cannot collide. Under
    ``nodes: MIN-MAX`` the expected world size is computed by the batch shell from the nodes
    this attempt got."""
    contract = contract_exports(spec)
    if spec.min_nodes is not None:  # first, where exports() puts it for a fixed count
        contract = {EXPECTED_WORLD_SIZE_VAR: _nodes_times(spec.procs), **contract}
    return [(key, spec.env[key]) for key in sorted(spec.env)] + list(contract.items())


def _nodes_times(count: int) -> str:
    """``count`` x this attempt's node count, as the batch shell computes it."""
    return _ShellExpansion(f'"$((SLURM_JOB_NUM_NODES * {int(count)}))"')


def _node_count(spec: JobSpec) -> str:
    """The job's node count in the script: the spec's, or this attempt's for a range."""
    return str(spec.nodes) if spec.min_nodes is None else NUM_NODES_EXPANSION


def endpoint_command(spec: JobSpec) -> list[str]:
    """The command printing the c10d endpoint ``host:port`` inside the job (torchrun mode)."""
    port = "auto" if spec.rdzv_port in (None, "auto") else str(spec.rdzv_port)
    return [spec.python, "-m", ENDPOINT_MODULE, "--port", port]


def torchrun_command(
    spec: JobSpec,
    *,
    endpoint: str = ENDPOINT_EXPANSION,
    rdzv_id: str = JOB_ID_EXPANSION,
    nnodes: int | str | None = None,
) -> list[str]:
    """The argv each node's single task runs under ``launch: torchrun``. The endpoint, the
    rendezvous id and (under ``nodes: MIN-MAX``) ``nnodes`` default to the batch shell's
    expansions, so the rendezvous waits for exactly the nodes SLURM gave; pass real values for
    a command to run elsewhere."""
    return [
        task_python(spec),
        "-u",
        "-m",
        CLI_MODULE,
        RUN_COMMAND,
        "--nnodes",
        _node_count(spec) if nnodes is None else str(nnodes),
        "--nproc-per-node",
        str(spec.procs),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        *ranks_filter(spec.log_ranks),
        *numa_flag(spec.numa_binding),
        *command_words(spec),
    ]


def task_python(spec: JobSpec) -> str:
    """The interpreter of the job step's tasks: the image's (``container.python``) or ``python``."""
    return spec.python if spec.container is None else spec.container.python or spec.python


def _words(words: list[str]) -> str:
    return "".join(f"{shlex.quote(word)} " for word in words)


def template_context(spec: JobSpec) -> dict[str, Any]:
    """Everything a template (built-in or the user's) can use, besides the filters."""
    torchrun = spec.launch == "torchrun"
    ranged = spec.min_nodes is not None
    markers = spec.procs + (1 if torchrun else 0)  # per node: its workers (and its agent)
    return {
        "spec": spec,
        "name": spec.name,
        "launch": spec.launch,
        "nodes": spec.nodes,  # a range's MAX; node_count is this attempt's
        "node_range": spec.node_range,
        "min_nodes": spec.min_nodes,  # None: a fixed count
        "node_count": _node_count(spec),
        "procs": spec.procs,
        "world_size": spec.world_size,
        "world_shown": (
            f"{spec.min_world_size}-{spec.world_size}" if ranged else str(spec.world_size)
        ),
        # srun mode under a range: the job asks for a task per node, the step for procs each
        "srun_tasks": f"--ntasks-per-node={spec.procs} " if ranged and not torchrun else "",
        # the spec's cpu_bind/gpu_bind: srun's own options, checked by the spec (spec_bind)
        "srun_binding": _words(srun_binding(spec.cpu_bind, spec.gpu_bind)),
        # the spec's container (spec_container): pyxis's srun options, apptainer's exec words
        "srun_container": _words(pyxis_options(spec.container)),
        "task_prefix": _words(apptainer_prefix(spec.container)),
        "task_python": task_python(spec),
        "sbatch_options": sbatch_options(spec),
        "workdir": spec.workdir,
        "log_dir": spec.log_path,
        "batch_output": batch_output_path(spec),
        "task_output": task_output_pattern(spec),
        "setup": list(spec.setup),
        "exports": _exports(spec),
        "python": spec.python,
        "resv_ports_module": RESV_PORTS_MODULE,
        "stop_hold_module": STOP_HOLD_MODULE,
        LAUNCH_TEMPLATE_NAME: BUILTIN_TEMPLATES[spec.launch],
        # markers the batch shell waits for: every worker, and under torchrun every agent
        "latch_markers": _nodes_times(markers) if ranged else spec.nodes * markers,
        "command": command_words(spec),
        "cpus_per_srun_task": spec.cpus_per_slurm_task,
        "signal": spec.signal,
        "signal_delay_s": spec.warning_s,
        "endpoint_command": endpoint_command(spec) if torchrun else [],
        "torchrun_argv": torchrun_command(spec) if torchrun else [],
        "sweep": _sweep_context(spec),
        "health": _health_context(spec),
    }


def _health_context(spec: JobSpec) -> dict[str, Any] | None:
    """The health check's part of the script (:mod:`ddpkit.cluster.stop.exclude`), or None."""
    if spec.health_check is None:
        return None
    return {
        "check": spec.health_check,
        "timeout_s": spec.health_check_timeout_s,
        # srun's own bound: the check's, plus the time to start a step on every node
        "step_timeout_s": spec.health_check_timeout_s + HEALTH_STEP_MARGIN_S,
        "max_excluded": spec.max_excluded_nodes,
        "health_module": HEALTH_MODULE,
        "exclude_module": EXCLUDE_MODULE,
        "exit_requeued": EXIT_REQUEUED,
    }


# ---- templates ----------------------------------------------------------------------------

_TEMPLATE_HINT = (
    "a template can use {names} and the filters q (bash) and sbatch_q (#SBATCH); "
    "see the built-in ones in ddpkit/templates/"
)


def _template_path(spec: JobSpec) -> Path | None:
    """The user's template file (relative paths are relative to ``workdir``), or None."""
    if spec.template is None:
        return None
    path = Path(spec.template).expanduser()
    return path if path.is_absolute() else Path(spec.workdir) / path


def _template_error(err: Exception, filename: str, names: list[str]) -> ConfigError:
    """A ConfigError naming the template file and line of ``err``."""
    hint = _TEMPLATE_HINT.format(names=", ".join(names))
    message = err.message if isinstance(err, jinja2.TemplateError) else None
    if isinstance(err, jinja2.TemplateSyntaxError):
        where = f"{err.filename or err.name or filename}, line {err.lineno}"
        hint = "fix the Jinja2 syntax there; " + hint
    else:
        # Jinja2 rewrites render tracebacks so that template frames carry the template's own
        # file name and line: the last such frame is where it failed.
        frames = traceback.extract_tb(err.__traceback__)
        lines = [frame.lineno for frame in frames if frame.filename == filename]
        where = f"{filename}, line {lines[-1]}" if lines else filename
    if isinstance(err, sandbox.SecurityError | sandbox.TemplateTooLong | MemoryError):
        hint = f"{sandbox.SANDBOX_HINT}; " + hint
    if message is None:  # a Python error inside a user's template: 1/0, 'a' + 1, ...
        message = f"{type(err).__name__}: {shown(str(err), quote=False)}"
    return ConfigError(f"sbatch template {where}: {message}", hint=hint)


def render_sbatch(spec: JobSpec) -> str:
    """The sbatch script for ``spec``: the user's template if the spec names one, else ours.
    A user's template must keep the stop-signal protocol (:mod:`ddpkit.jobs.user_template`).

    Both render in Jinja2's sandbox (:mod:`ddpkit.jobs.sandbox`): a template cannot run code
    or read the environment of this machine; a violation is a ConfigError naming its line.
    """
    user_path = _template_path(spec)
    name = str(user_path) if user_path is not None else BUILTIN_TEMPLATES[spec.launch]
    context = template_context(spec)
    names = sorted(context)
    # a user's template may fail in any way Python code can; ddpkit's own only as Jinja2 does
    caught = Exception if user_path is not None else jinja2.TemplateError
    filters = {"q": shell_quote, "sbatch_q": sbatch_quote}
    top = None if user_path is None else str(user_path)  # reads files of its own folder only
    environment = sandbox.sandbox_environment(_BUILTIN_NAMES, filters, top)
    try:
        template = environment.get_template(name)
    except jinja2.TemplateError as err:
        raise _template_error(err, name, names) from err
    try:
        text = sandbox.collect(template.generate(context))
    except DdpkitError:
        raise  # a value the q filters refuse (a NUL): its own message names it
    except caught as err:
        raise _template_error(err, template.filename or name, names) from None
    if user_path is not None:  # after rendering: its own errors come first, as they always did
        check_user_template(environment, name, _BUILTIN_NAMES, spec.signal)
    return text
