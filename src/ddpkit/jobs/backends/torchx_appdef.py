"""Job specs to torchx ``AppDef``s: the one conversion, shared by ``ddpkit.components``.

``spec_to_appdef(spec)`` serves the ``ddpkit.ddp`` component (``spec=job.yaml``) and
``ddpkit submit --via torchx``; ``ddp_appdef(...)`` is the builder underneath, which the
component also calls with its own flags.

What every replica (one per node) runs, whichever torchx scheduler starts it::

    bash -c '<cd workdir>; <setup lines>; <export of comma values>;
             exec python -u -m ddpkit run --nnodes N --nproc-per-node P ... <command>'

* One node: ``ddpkit run --standalone`` (as ``dist.ddp`` uses ``localhost:0``). Several
  nodes: a c10d rendezvous at ``${<rank0_env>:=localhost}:<port>`` with ``--rdzv-id <app_id>``,
  torchx's macros as ``dist.ddp`` uses them. ``rdzv_port: auto`` (or unset) derives the port
  from the app id (``ports.port_for_job``), so two jobs sharing a node do not collide.
* Always ``bash -c`` (never the bare command): the endpoint needs the shell, and ``setup`` lines
  are verbatim shell that must run in the same process that then ``exec``s ``ddpkit run`` (so
  ``source venv/bin/activate`` or ``module load`` affects it). Every other word is
  ``shlex.quote``d; every ``$`` of user text is doubled, because torchx runs args and env values
  through ``string.Template`` (its macros) and would otherwise eat ``$$`` or expand
  ``${app_id}``.
* Env values containing a comma are exported by the wrapper instead of ``Role.env``: torchx's
  slurm scheduler passes ``Role.env`` as ``srun --export=ALL,K=V,...``, which silently cuts a
  value at its first comma (``A=x,y`` arrives as ``A=x``; checked on SLURM 22.05).
* The spec's ``launch`` does not apply: under torchx every node runs one ``ddpkit run``
  (``DDPKIT_JOB_LAUNCH=torchrun``). partition, time and constraint are torchx's own slurm run
  options (``scheduler_cfg``). ``account``, ``qos`` and the ``sbatch:`` options have none in
  torchx 0.7: the role carries them to each node's ``#SBATCH`` group (:func:`slurm_role_type`),
  quoted for sbatch's parser, as torchx writes them unquoted (a partition with a space and
  ``--export=...`` would be two options). An option for the whole job
  (:data:`JOB_WIDE_SBATCH`) is refused: torchx would write it in every node's het component.
  ``log_dir`` and ``template`` are sbatch-script matters and not used.

torchx is an optional extra, imported only inside these functions (:func:`import_torchx`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import json
import math
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ddpkit import compat
from ddpkit.cluster.envvars import number_hint
from ddpkit.cluster.rendezvous.endpoint import RDZV_STEP
from ddpkit.contract import CLI_MODULE, RUN_COMMAND
from ddpkit.errors import ConfigError
from ddpkit.jobs.backends import refuse_sbatch_only
from ddpkit.jobs.exports import exports as contract_exports
from ddpkit.jobs.render import sbatch_extras, sbatch_quote
from ddpkit.jobs.spec_bind import numa_flag
from ddpkit.jobs.spec_chain import ranks_filter

if TYPE_CHECKING:
    from torchx.specs import AppDef  # type: ignore[import-untyped]

    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "INSTALL_HINT",
    "JOB_WIDE_SBATCH",
    "add_sbatch_options",
    "appdef_to_dict",
    "ddp_appdef",
    "import_torchx",
    "parse_j",
    "refuse_sweep",
    "scheduler_cfg",
    "slurm_role_type",
    "spec_to_appdef",
]

INSTALL_HINT = "install the torchx extra: pip install ddpkit[torchx]"
_J = re.compile(r"(?:([0-9]+)x)?([0-9]+)")  # fullmatch: "$" would match before a final newline
_ROLE_NAME = re.compile(r"[^A-Za-z0-9_-]+")
# sbatch: options whose value is for the whole job; torchx would write them into every node's
# het component, each asking for all of it.
JOB_WIDE_SBATCH = {
    "gpus": "the GPUs of the whole job (set gpus_per_node instead)",
    "nodelist": "the job's nodes: each one-node component would ask for all of them",
    "nodefile": "the job's nodes: each one-node component would ask for all of them",
}
# Options that already say how many GPUs a node gets: torchx's own gpus-per-task is dropped.
_GPU_OPTIONS = ("gres", "gpus-per-task")


class _Shell(str):
    """A word the replica's bash must expand (the endpoint); written without quotes."""

    __slots__ = ()


def import_torchx(module: str = "specs") -> Any:
    """``torchx.<module>``, or a ConfigError naming the extra to install: the one import of
    torchx for the component and the torchx backend alike."""
    try:
        return importlib.import_module(f"torchx.{module}")
    except ImportError as err:
        raise ConfigError(
            f"torchx cannot be imported ({err})", hint=f"{INSTALL_HINT}, or use --via sbatch"
        ) from err


def parse_j(j: str) -> tuple[int, int]:
    """torchx's ``-j``: ``NxM`` (N nodes x M processes per node) or ``M`` (one node)."""
    match = _J.fullmatch(j.strip())
    nodes, procs = (int(match[1] or 1), int(match[2])) if match else (0, 0)
    if nodes < 1 or procs < 1:
        raise ConfigError(
            f"-j={j!r} is not NODESxPROCS",
            hint=number_hint(
                j, "e.g. -j 2x4 (2 nodes, 4 processes each) or -j 4 (1 node); both at least 1"
            ),
        )
    return nodes, procs


def _template_literal(text: str) -> str:
    """``text`` surviving torchx's ``string.Template`` macro pass unchanged."""
    return text.replace("$", "$$")


def _word(word: str) -> str:
    return str.__str__(word) if type(word) is _Shell else shlex.quote(_template_literal(word))


def _endpoint(specs: Any, rdzv_port: int | None, python: str) -> _Shell:
    """``${<rank0 host var>:=localhost}:<port>``; port None: derived from the app id."""
    host = f"$${{{specs.macros.rank0_env}:=localhost}}"
    if rdzv_port is not None:
        return _Shell(f"{host}:{rdzv_port}")
    code = (
        "import sys; from ddpkit.cluster.rendezvous.ports import port_for_job; "
        f"print(port_for_job(sys.argv[1], {json.dumps(RDZV_STEP)}))"
    )
    port = f"$$({_word(python)} -c {_word(code)} {specs.macros.app_id})"
    return _Shell(f'"{host}:{port}"')


def ddp_appdef(
    *,
    name: str,
    command: Sequence[str],
    nodes: int,
    procs: int,
    python: str = "python",
    role_name: str | None = None,
    cpu: int = 1,
    gpu: int = 0,
    mem_mb: int = 1024,
    h: str | None = None,
    env: Mapping[str, str] | None = None,
    max_retries: int = 0,
    rdzv_port: int | None = 29500,
    setup: Sequence[str] = (),
    workdir: str | None = None,
    sbatch: Mapping[str, str | None] | None = None,
    log_ranks: Sequence[int] | None = None,
    numa_binding: str | None = None,
) -> AppDef:
    """One role of ``nodes`` replicas, each running ``ddpkit run`` for ``procs`` processes.

    ``nodes`` and ``procs`` are at least 1 (checked by ``parse_j`` and the spec). ``command`` is
    a script and its arguments, or ``-m module ...``. ``env`` is copied, never modified
    (torchx's local scheduler writes PATH into ``Role.env``). ``sbatch``: more ``#SBATCH``
    options for each node under torchx's slurm scheduler (see :class:`SlurmRole`).
    """
    specs = import_torchx()
    # the bash -c text each replica runs (torchx macros still in it; see the module doc)
    argv: list[str] = [python, "-u", "-m", CLI_MODULE, RUN_COMMAND, "--nnodes", str(nodes)]
    argv += ["--nproc-per-node", str(procs)]
    if nodes == 1:
        argv.append("--standalone")
    else:
        endpoint = _endpoint(specs, rdzv_port, python)
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        argv += ["--rdzv-id", _Shell(specs.macros.app_id)]
    argv += ranks_filter(log_ranks)  # torchrun's filter of the local ranks that print
    argv += numa_flag(numa_binding)  # torchrun's --numa-binding
    env = dict(env or {})
    exports = {key: env.pop(key) for key in sorted(env) if "," in env[key]}  # see module doc
    lines = [f"cd -- {_word(workdir)}"] if workdir is not None else []
    lines += [_template_literal(line) for line in setup]  # verbatim shell, by design
    lines += [f"export {key}={_word(value)}" for key, value in exports.items()]
    lines.append("exec " + " ".join(_word(word) for word in [*argv, *command]))
    role = slurm_role_type()(
        sbatch=dict(sbatch or {}),
        name=role_name or _role_name(command, name),
        image="",
        entrypoint="bash",
        args=["-c", "\n".join(lines)],
        env={key: _template_literal(value) for key, value in env.items()},
        num_replicas=nodes,
        max_retries=max_retries,
        # not specs.resource(): it turns 0 into its defaults (cpu 2, memMB 1024)
        resource=specs.resource(h=h) if h else specs.Resource(cpu=cpu, gpu=gpu, memMB=mem_mb),
        port_map={"c10d": rdzv_port} if nodes > 1 and rdzv_port is not None else {},
    )
    return specs.AppDef(name=name, roles=[role])


@functools.cache
def slurm_role_type() -> type:
    """``SlurmRole``: a torchx ``Role`` with ``sbatch`` options for the slurm scheduler.

    Its ``pre_proc`` (torchx's hook for role-specific changes to a scheduler request, called
    on every dry run) adds them to each replica's ``#SBATCH`` group and quotes every value
    there (:func:`add_sbatch_options`). Made on first use: torchx is an optional import.
    """
    role: Any = import_torchx().Role

    @dataclasses.dataclass
    class SlurmRole(role):  # type: ignore[misc]
        sbatch: dict[str, str | None] = dataclasses.field(default_factory=dict)

        def pre_proc(self, scheduler: str, dryrun_info: Any) -> Any:
            if scheduler == "slurm":
                add_sbatch_options(dryrun_info.request, self.name, self.sbatch)
            return dryrun_info

    SlurmRole.__module__ = __name__
    return SlurmRole


def add_sbatch_options(request: Any, role: str, options: Mapping[str, str | None]) -> None:
    """Add ``options`` to every replica of ``role`` in torchx's slurm request, then quote every
    value of those ``#SBATCH`` groups for sbatch's own parser (torchx writes them as they are).
    A GPU option among ``options`` replaces torchx's ``gpus-per-task``."""
    for group in compat.torchx_slurm_sbatch_options(request, role):
        if any(key in _GPU_OPTIONS for key in options):
            group.pop("gpus-per-task", None)
        group.update(options)
        for key, value in group.items():
            if value is not None:
                group[key] = sbatch_quote(value)


def _sbatch_options(spec: JobSpec) -> dict[str, str | None]:
    """account, qos and the ``sbatch:`` options of ``spec`` for each node's ``#SBATCH`` group
    (true: a bare flag; false: left out); a whole-job option is refused (JOB_WIDE_SBATCH)."""
    extras = sbatch_extras(spec)
    wide = sorted(extras.keys() & JOB_WIDE_SBATCH.keys())
    if wide:
        key = wide[0]
        raise ConfigError(
            f"sbatch.{key}={spec.sbatch[key]!r} cannot go through torchx: {JOB_WIDE_SBATCH[key]}"
            "; torchx submits one het component per node and writes each option in all",
            hint="submit with --via sbatch, which writes it once for the whole job",
        )
    names = {"account": spec.account, "qos": spec.qos}
    return {k: v for k, v in names.items() if v is not None} | extras


def _role_name(command: Sequence[str], fallback: str) -> str:
    """The script's stem or the module's last part (as ``dist.ddp`` names its role)."""
    target = command[1] if command[:1] == ["-m"] and len(command) > 1 else command[0]
    stem = target.rsplit("/", 1)[-1].removesuffix(".py").rsplit(".", 1)[-1]
    return _ROLE_NAME.sub("-", stem).strip("-") or fallback


def _check_scheduler(scheduler: str) -> None:
    from torchx.schedulers import get_scheduler_factories  # type: ignore[import-untyped]

    known = sorted(get_scheduler_factories())
    if scheduler not in known:
        raise ConfigError(
            f"scheduler={scheduler!r} is not a torchx scheduler",
            hint=f"one of {', '.join(known)}",
        )


def refuse_sweep(spec: JobSpec) -> None:
    """Refuse, before anything is submitted, what torchx cannot carry rather than half-do it:
    a sweep (torchx has no job arrays: its slurm scheduler submits one heterogeneous job per
    AppDef, local_cwd runs one app in the foreground, so N unrelated jobs would lack the
    array's one id, throttle and per-task requeue), what only ddpkit's sbatch scripts carry
    (``refuse_sbatch_only``; no AppDef role honours a node range), srun's binding, a container
    and a chain (torchx has no dependency between apps)."""
    if spec.sweep is not None:
        raise ConfigError(
            f"sweep ({spec.sweep.count} runs) cannot go through torchx, which has no job "
            "arrays (one job per AppDef)",
            hint="submit the sweep with --via sbatch (one SLURM array) or --via submitit "
            "(map_array)",
        )
    why = "slurm scheduler submits one job component per node: a fixed count"
    refuse_sbatch_only(spec, "torchx", why, " (its workdir is its own)")
    if spec.cpu_bind is not None or spec.gpu_bind is not None:
        bind = "cpu_bind" if spec.cpu_bind is not None else "gpu_bind"
        raise ConfigError(
            f"{bind}={getattr(spec, bind)!r} is srun's --{bind.replace('_', '-')}, which "
            "torchx's scheduler does not pass on",
            hint=f"submit with --via sbatch or --via submitit, or remove {bind}",
        )
    if spec.container is not None:
        raise ConfigError(
            f"container (runtime {spec.container.runtime}) runs ddpkit's job step in an image, "
            "which torchx's scheduler does not pass on",
            hint="submit with --via sbatch or --via submitit, or remove container",
        )
    if spec.after or spec.singleton:
        chain = f"after={spec.after!r}" if spec.after else "singleton=true"
        raise ConfigError(
            f"{chain} cannot go through torchx, which has no job dependencies",
            hint="submit with --via sbatch or --via submitit (both write sbatch --dependency)",
        )


def spec_to_appdef(spec: JobSpec, *, scheduler: str = "local_cwd") -> AppDef:
    """THE conversion of a job spec to a torchx AppDef (see the module doc for the choices):
    one role named after the spec, a replica per node, resources per node. The AppDef is the
    same for every scheduler (torchx fills in its macros); ``scheduler`` is checked so that a
    typo fails before anything is submitted."""
    refuse_sweep(spec)
    import_torchx()
    _check_scheduler(scheduler)
    env = {**spec.env, **contract_exports(spec, launch="torchrun")}  # the job contract too
    port = spec.rdzv_port if isinstance(spec.rdzv_port, int) else None
    return ddp_appdef(
        name=spec.name,
        role_name=spec.name,
        command=spec.command,
        nodes=spec.nodes,
        procs=spec.procs,
        python=spec.python,
        cpu=spec.procs * spec.cpus_per_task,
        gpu=spec.gpus_per_node,
        # 0: no memory request (torchx's slurm scheduler then leaves out --mem)
        mem_mb=0 if spec.mem_gb is None else math.ceil(spec.mem_gb * 1024),
        env=env,
        max_retries=0,
        rdzv_port=port,
        setup=spec.setup,
        workdir=spec.workdir,
        sbatch=_sbatch_options(spec),
        log_ranks=spec.log_ranks,
        numa_binding=spec.numa_binding,
    )


def scheduler_cfg(spec: JobSpec, scheduler: str) -> dict[str, str]:
    """The spec's scheduler options torchx knows (slurm: partition, time, constraint)."""
    if scheduler != "slurm":
        return {}
    names = {"partition": spec.partition, "constraint": spec.constraint}
    return {"time": str(spec.time_min)} | {k: v for k, v in names.items() if v is not None}


def _plain(value: Any) -> Any:
    """Dataclasses, enums and containers of an AppDef as JSON values (dict keys sorted)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Mapping):
        return {str(key): _plain(value[key]) for key in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def appdef_to_dict(app: AppDef) -> dict[str, Any]:
    """A stable, JSON-able view of ``app`` (every field of AppDef/Role/Resource, keys sorted).

    The replica script is also given split into lines (``script_lines``) for readable diffs.
    """
    data: dict[str, Any] = _plain(app)
    for role in data["roles"]:
        args = role["args"]
        if role["entrypoint"] == "bash" and len(args) == 2 and args[0] == "-c":
            role["script_lines"] = args[1].splitlines()
    return data
