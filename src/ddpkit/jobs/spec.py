"""Job specs and cluster profiles: the typed, validated, frozen description of a SLURM job.

This module owns the fields of a job spec (``JobSpec``) and a site profile (``ClusterProfile``),
every check on them (errors built by :func:`~ddpkit.jobs.spec_checks.invalid`; field
descriptions double as the hint for type errors), and the values derived from them. Reading
YAML and merging the layers is ``ddpkit.jobs.load``; nothing here touches a file.

Quoting is the renderer's job: values legitimate in a shell word (quotes, ``;``, ``$()``) are
accepted. Rejected are only values that cannot be carried at all: NUL anywhere, and line breaks
in anything that reaches an ``#SBATCH`` line or a file name.
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
import sys
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from ddpkit.cluster.stop.signals import JobSignal
from ddpkit.contract import DEFAULT_MAX_REQUEUES, DEFAULT_SIGNAL, RUN_ID_VAR, reserved_env_hint
from ddpkit.jobs import spec_checks
from ddpkit.jobs.snapshot import SNAPSHOT_DOC
from ddpkit.jobs.spec_bind import BIND_DOCS, CpuBind, GpuBind, NumaBinding, check_binding
from ddpkit.jobs.spec_chain import CHAIN_DOCS, AfterList, AfterType, LogRanks, check_log_ranks
from ddpkit.jobs.spec_checks import Model, invalid, listed, no_nul, number_to_str, stripped_hint
from ddpkit.jobs.spec_container import CONTAINER_DOC, Container
from ddpkit.jobs.sweep_spec import (
    SHARED_RUN_ID,
    SHARED_RUN_ID_HINT,
    SWEEP_DESCRIPTION,
    Sweep,
    check_placeholders,
)

__all__ = ["RESERVED_SBATCH", "ClusterProfile", "JobSpec", "Launch"]

Launch = Literal["srun", "torchrun"]
DEFAULT_SIGNAL_DELAY_S = 120

# Always used with fullmatch: ``$`` (and ``re.match`` with it) also matches before a final
# newline, so "FOO\n" would pass and break the rendered script (``export FOO`` / ``=x``).
_NAME = re.compile(r"[A-Za-z0-9._-]+")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SBATCH_KEY = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")

# #SBATCH options that a spec field already sets: one source of truth for each.
RESERVED_SBATCH: dict[str, str] = {
    "job-name": "set name instead",
    "nodes": "set nodes instead",
    "ntasks": "set nodes and procs_per_node instead",
    "ntasks-per-node": "set procs_per_node instead",
    "cpus-per-task": "set cpus_per_task instead",
    "gpus-per-node": "set gpus_per_node instead",
    "time": "set time_min instead",
    "mem": "set mem_gb instead",
    "partition": "set partition instead",
    "account": "set account instead",
    "qos": "set qos instead",
    "constraint": "set constraint instead",
    "output": "set log_dir instead; ddpkit names the files",
    "error": "set log_dir instead; ddpkit names the files",
    "chdir": "set workdir instead",
    # ranks are laid out node by node (block), which rank_layout and the templates rely on
    "distribution": "remove it: ddpkit places ranks node by node",
    "signal": "set signal and signal_delay_s instead",
    "requeue": "set max_requeues instead (0: never requeue)",
    "no-requeue": "set max_requeues: 0 instead",
    "array": "declare a sweep: instead (one array task per run)",
    "dependency": "set after (and after_type) or singleton: true instead",
}


def _one_line(text: str) -> str:
    no_nul(text)
    if "".join(text.splitlines()) != text:
        raise invalid(
            "contains a line break, which would end its #SBATCH line or file name",
            "write it on one line",
        )
    if not text.strip():
        raise invalid("is empty", "remove the key (or write null) to leave it unset")
    return text


def _check_name(text: str) -> str:
    if not _NAME.fullmatch(text):
        fixed = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "my-job"
        raise invalid(
            "may only contain letters, digits, '.', '_' and '-' (it names files and the job)",
            stripped_hint(text, _NAME) or f"e.g. {spec_checks.shown(fixed)}",
        )
    return text


def _split_command(value: object) -> object:
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise invalid(
                f"cannot be split into words ({exc})",
                "balance the quotes, or write the command as a YAML list",
            ) from None
    if isinstance(value, list | tuple):
        return [number_to_str(item) for item in value]
    return value


def _check_command(words: list[str]) -> list[str]:
    example = "command: train.py --lr 0.1 (a script) or command: -m pkg.train (a module)"
    if not words or not words[0]:
        raise invalid("is empty", f"e.g. {example}")
    first = words[0]
    if first == "-m":
        if len(words) < 2:
            raise invalid("has '-m' without a module name", "e.g. command: -m pkg.train --lr 0.1")
        if not _MODULE.fullmatch(words[1]):
            raise invalid(
                f"has {spec_checks.shown(words[1])} after '-m', which is not a module name",
                "a dotted Python name, e.g. -m pkg.train",
            )
    elif first.startswith("-"):
        hint = f"write '-m {first[2:]}'" if first.startswith("-m") else f"e.g. {example}"
        raise invalid(
            f"starts with {spec_checks.shown(first)}: only '-m' may come before the program", hint
        )
    return words


def _check_env_key(key: str) -> str:
    if not _ENV_KEY.fullmatch(key):
        fixed = re.sub(r"[^A-Za-z0-9_]", "_", key)
        fixed = fixed if _ENV_KEY.fullmatch(fixed) else "_" + fixed
        raise invalid(
            "is not a valid environment variable name",
            stripped_hint(key, _ENV_KEY)
            or "letters, digits and '_', not starting with a digit, "
            f"e.g. {spec_checks.shown(fixed)}",
        )
    reserved = reserved_env_hint(key)
    if reserved is not None:
        raise invalid("is set by ddpkit", reserved)
    return key


def _check_sbatch_key(key: str) -> str:
    if key.startswith("-"):
        raise invalid(
            "starts with '-'", f"write {spec_checks.shown(key.lstrip('-'))}: ddpkit adds the dashes"
        )
    if not _SBATCH_KEY.fullmatch(key):
        raise invalid(
            "is not an sbatch long option name",
            stripped_hint(key, _SBATCH_KEY)
            or "lower-case words joined by '-', e.g. exclusive or mail-type",
        )
    if key in RESERVED_SBATCH:
        raise invalid("is set by ddpkit from a spec field", RESERVED_SBATCH[key])
    return key


def _check_sbatch_value(value: object) -> object:
    if isinstance(value, str):
        return _one_line(value)
    if not isinstance(value, int | bool):
        raise invalid(
            f"is a {type(value).__name__}, not a string, integer or true/false",
            "e.g. exclusive: true, or gres: 'gpu:2' (true writes the bare flag, false omits it)",
        )
    return value


def _check_port(value: object) -> object:
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise invalid(
            "is not a TCP port or 'auto'",
            "set rdzv_port: auto (derived from the job id) or a port number 1..65535",
        )
    return value


def _check_absolute(path: str) -> str:
    _one_line(path)
    if not posixpath.isabs(path):
        raise invalid("is not an absolute path", "ddpkit.jobs.load_spec resolves relative ones")
    return path


def _check_host_template(template: str) -> str:
    _one_line(template)
    if "{host}" not in template:
        raise invalid("does not contain '{host}'", "e.g. '{host}-ib' or '{host}.ib.cluster'")
    return template


Text = Annotated[str, AfterValidator(no_nul)]
Line = Annotated[str, AfterValidator(_one_line)]
Name = Annotated[str, AfterValidator(_check_name)]
Command = Annotated[list[Text], BeforeValidator(_split_command), AfterValidator(_check_command)]
Setup = Annotated[list[Text], BeforeValidator(listed)]
EnvMap = dict[
    Annotated[str, AfterValidator(_check_env_key)],
    Annotated[Text, BeforeValidator(number_to_str)],
]
SbatchMap = dict[
    Annotated[str, AfterValidator(_check_sbatch_key)],
    Annotated[str | int | bool, BeforeValidator(_check_sbatch_value)],
]
HostTemplate = Annotated[str, AfterValidator(_check_host_template)]
RdzvPort = Annotated[int | Literal["auto"] | None, BeforeValidator(_check_port)]

# Field descriptions: documentation, and the hint for a value of the wrong type.
_D_NODES = (
    "a whole number >= 1, or a range MIN-MAX (each attempt on as many as SLURM gives; sbatch "
    "only), e.g. nodes: 2 or nodes: 1-2"
)
_D_MIN_NODES = (
    "not a key of its own: nodes: MIN-MAX sets it to MIN (nodes to MAX); null: a fixed count"
)
_D_NAME = "letters, digits, '.', '_' and '-', e.g. name: train-resnet"
_D_PYTHON = "the interpreter on the nodes, e.g. python: /opt/venv/bin/python"
_D_GPUS = "0 on CPU nodes, e.g. gpus_per_node: 8"
_D_CPUS = "CPUs per process, a whole number >= 1, e.g. cpus_per_task: 4"
_D_CPUS_NODE = "CPUs one node has (a site fact, usually from the profile), e.g. cpus_per_node: 64"
_D_MEM = "memory per node in GB, e.g. mem_gb: 32"
_D_TIME = "time limit in minutes, a whole number >= 1, e.g. time_min: 120"
_D_SLURM = "a SLURM name on one line, e.g. partition: gpu"
_D_ENV = "a mapping of strings; quote yes/no/true/false/on/off, e.g. env: {NCCL_DEBUG: INFO}"
_D_SETUP = "shell lines run before the job, e.g. setup: ['module load cuda/12.4']"
_D_LOG = "a directory, relative to workdir, e.g. log_dir: logs"
_D_SBATCH = "other #SBATCH options, e.g. sbatch: {exclusive: true, gres: 'gpu:2'}"
_D_TEMPLATE = "the path of an sbatch Jinja2 template, e.g. template: my-sbatch.sh.j2"
_D_HOST = "how to name a node on the fast network, e.g. host_template: '{host}-ib'"
_D_SIGNAL = "USR2 (default) or USR1, sent before the time limit; null: none"
_D_SIGNAL_DELAY = "seconds before the time limit (default 120, at most half of it), e.g. 300"
_D_HANG = (
    "the hang watchdog's per-collective bound in seconds (DDPKIT_HANG_TIMEOUT; default 180, "
    "0: off), e.g. hang_timeout_s: 300"
)
_D_HANG_FIRST = (
    "the hang watchdog's bound before the first step (DDPKIT_HANG_FIRST_TIMEOUT; default "
    "900), e.g. hang_first_timeout_s: 1800"
)
_D_REQUEUES = "how often the job may requeue itself, a whole number >= 0, e.g. max_requeues: 10"
_D_HEALTH = (
    "a shell line run on every node at the start of each attempt and after a failed step "
    "(sbatch only); a node where it fails is excluded and the job requeued, e.g. "
    "health_check: 'nvidia-smi -L'"
)
_D_HEALTH_TIMEOUT = "seconds the health check may take on a node (default 60), e.g. 120"
_D_EXCLUDED = (
    "how many nodes a failed health check may exclude from the job (default 2; 0: none, the "
    "job fails instead), e.g. max_excluded_nodes: 2"
)
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 60
DEFAULT_MAX_EXCLUDED_NODES = 2


class JobSpec(Model):
    """One job: what to run, on how many nodes and processes, and how SLURM should place it.

    Ranks are node-major: global rank = node * procs + local rank, in both launch modes.
    ``launch: srun`` starts one SLURM task per process; ``launch: torchrun`` one task per node
    that runs ``ddpkit run`` (torchrun) with a c10d rendezvous at the first node.
    """

    name: Name = Field(description=_D_NAME)
    command: Command = Field(description="a script or -m and a module, e.g. train.py --lr 0.1")
    python: Line = Field(default_factory=lambda: sys.executable, description=_D_PYTHON)
    nodes: int = Field(1, ge=1, le=spec_checks.MAX_NODES, description=_D_NODES)
    # not a key of its own: `nodes: MIN-MAX` sets it (and nodes to MAX); None: a fixed count
    min_nodes: int | None = Field(None, ge=1, le=spec_checks.MAX_NODES, description=_D_MIN_NODES)
    gpus_per_node: int = Field(0, ge=0, le=spec_checks.MAX_PER_NODE, description=_D_GPUS)
    procs_per_node: int | None = Field(
        None,
        ge=1,
        le=spec_checks.MAX_PER_NODE,
        description="default: one per GPU, or 1; e.g. procs_per_node: 4",
    )
    cpus_per_task: int = Field(1, ge=1, le=spec_checks.MAX_CPUS, description=_D_CPUS)
    cpus_per_node: int | None = Field(None, ge=1, le=spec_checks.MAX_CPUS, description=_D_CPUS_NODE)
    mem_gb: float | None = Field(
        None, gt=0, le=spec_checks.MAX_MEM_GB, allow_inf_nan=False, description=_D_MEM
    )
    time_min: int = Field(60, ge=1, le=spec_checks.MAX_TIME_MIN, description=_D_TIME)
    partition: Line | None = Field(None, description=_D_SLURM)
    account: Line | None = Field(None, description=_D_SLURM)
    qos: Line | None = Field(None, description=_D_SLURM)
    constraint: Line | None = Field(None, description=_D_SLURM)
    env: EnvMap = Field(default_factory=dict, description=_D_ENV)
    setup: Setup = Field(default_factory=list, description=_D_SETUP)
    launch: Launch = Field("srun", description="srun: a task per process; torchrun: per node")
    # None (unset) is auto: a multi-node torchrun job needs a port, and the job-derived one is
    # what a user would pick by hand (ddpkit.jobs.render.endpoint_command).
    rdzv_port: RdzvPort = Field(None, description="torchrun's port: auto (default) or 1..65535")
    log_dir: Line = Field("ddpkit-logs", description=_D_LOG)
    workdir: Annotated[str, AfterValidator(_check_absolute)] = Field(
        default_factory=os.getcwd, description="the job's directory, an absolute path"
    )
    sbatch: SbatchMap = Field(default_factory=dict, description=_D_SBATCH)
    profile: Line | None = Field(None, description="a profile name or path, e.g. profile: site")
    template: Line | None = Field(None, description=_D_TEMPLATE)
    host_template: HostTemplate | None = Field(None, description=_D_HOST)
    signal: JobSignal | None = Field(DEFAULT_SIGNAL, description=_D_SIGNAL)
    signal_delay_s: int | None = Field(
        None, ge=1, le=spec_checks.MAX_TIME_MIN * 60, description=_D_SIGNAL_DELAY
    )
    max_requeues: int = Field(
        DEFAULT_MAX_REQUEUES, ge=0, le=spec_checks.MAX_REQUEUES, description=_D_REQUEUES
    )
    hang_timeout_s: float | None = Field(
        None, ge=0, le=spec_checks.MAX_TIME_MIN * 60, allow_inf_nan=False, description=_D_HANG
    )
    hang_first_timeout_s: float | None = Field(
        None, gt=0, le=spec_checks.MAX_TIME_MIN * 60, allow_inf_nan=False, description=_D_HANG_FIRST
    )
    sweep: Sweep | None = Field(None, description=SWEEP_DESCRIPTION)
    health_check: Line | None = Field(None, description=_D_HEALTH)
    health_check_timeout_s: int = Field(
        DEFAULT_HEALTH_CHECK_TIMEOUT_S, ge=1, le=24 * 3600, description=_D_HEALTH_TIMEOUT
    )
    max_excluded_nodes: int = Field(
        DEFAULT_MAX_EXCLUDED_NODES, ge=0, le=spec_checks.MAX_NODES, description=_D_EXCLUDED
    )
    after: AfterList = Field(default_factory=list, description=CHAIN_DOCS["after"])
    after_type: AfterType = Field("afterok", description=CHAIN_DOCS["after_type"])
    singleton: bool = Field(False, description=CHAIN_DOCS["singleton"])
    log_ranks: LogRanks | None = Field(None, description=CHAIN_DOCS["log_ranks"])
    snapshot: bool = Field(False, description=SNAPSHOT_DOC)
    cpu_bind: CpuBind | None = Field(None, description=BIND_DOCS["cpu_bind"])
    gpu_bind: GpuBind | None = Field(None, description=BIND_DOCS["gpu_bind"])
    numa_binding: NumaBinding | None = Field(None, description=BIND_DOCS["numa_binding"])
    container: Container | None = Field(None, description=CONTAINER_DOC)

    @model_validator(mode="before")
    @classmethod
    def _split_node_range(cls, data: object) -> object:
        return spec_checks.split_nodes(data)  # nodes: MIN-MAX -> nodes=MAX, min_nodes=MIN

    @model_validator(mode="after")
    def _check_placeholders(self) -> JobSpec:
        if self.sweep is not None:
            check_placeholders(self.command, self.sweep)
            if self.env.get(RUN_ID_VAR):
                raise invalid(
                    SHARED_RUN_ID,
                    f"leave it out: {SHARED_RUN_ID_HINT}",
                    field=f"env.{RUN_ID_VAR}",
                    value=self.env[RUN_ID_VAR],
                )
        return self

    @model_validator(mode="after")
    def _check_topology(self) -> JobSpec:
        if self.gpus_per_node > 0 and self.procs_per_node not in (None, self.gpus_per_node):
            raise invalid(
                f"differs from gpus_per_node={self.gpus_per_node}",
                f"ddpkit runs one process per GPU: drop procs_per_node or set it to "
                f"{self.gpus_per_node}",
                field="procs_per_node",
                value=self.procs_per_node,
            )
        needed = self.procs * self.cpus_per_task
        if self.cpus_per_node is not None and needed > self.cpus_per_node:
            raise invalid(
                f"{self.procs} processes x cpus_per_task={self.cpus_per_task} need {needed} CPUs "
                f"per node, more than cpus_per_node={self.cpus_per_node}",
                "lower procs_per_node or cpus_per_task, or fix cpus_per_node",
                field="procs_per_node",
                value=self.procs,
            )
        if self.log_ranks is not None:
            check_log_ranks(self.log_ranks, self.launch, self.procs)
        check_binding(self.cpu_bind, self.cpus_per_node, self.numa_binding, self.launch)
        delay = self.signal_delay_s
        if self.signal is not None and delay is not None and delay >= self.time_min * 60:
            raise invalid(
                f"is not shorter than the time limit (time_min={self.time_min}, "
                f"{self.time_min * 60} s): the warning would come at once, every run",
                f"a few minutes at most, e.g. signal_delay_s: {min(120, self.time_min * 30)}",
                field="signal_delay_s",
                value=delay,
            )
        return self

    @property
    def procs(self) -> int:
        """Processes per node: ``procs_per_node``, else one per GPU, else 1."""
        return self.procs_per_node if self.procs_per_node is not None else self.gpus_per_node or 1

    @property
    def warning_s(self) -> int:
        """Seconds between the stop signal and the time limit: ``signal_delay_s``, else 120 s
        or half the time limit when that is shorter."""
        default = min(DEFAULT_SIGNAL_DELAY_S, self.time_min * 30)
        return self.signal_delay_s if self.signal_delay_s is not None else default

    @property
    def world_size(self) -> int:
        """The world size on ``nodes`` nodes (a range's MAX: :attr:`min_world_size` is its MIN)."""
        return self.nodes * self.procs

    @property
    def min_world_size(self) -> int:
        """The smallest world size an attempt may start with: ``world_size`` for a fixed count."""
        return (self.min_nodes or self.nodes) * self.procs

    @property
    def node_range(self) -> str:
        """``nodes`` as written: ``"2"``, or ``"1-2"`` for a range (``--nodes`` for sbatch)."""
        return f"{self.min_nodes}-{self.nodes}" if self.min_nodes is not None else str(self.nodes)

    @property
    def is_module(self) -> bool:
        """True for ``-m pkg.mod ...`` (run as a module), False for ``script.py ...``."""
        return self.command[0] == "-m"

    @property
    def tasks_per_node(self) -> int:
        """SLURM tasks per node: one per process (srun), or one torchrun per node."""
        return self.procs if self.launch == "srun" else 1

    @property
    def cpus_per_slurm_task(self) -> int:
        """``--cpus-per-task`` for SLURM: a torchrun task hosts all processes of its node."""
        return self.cpus_per_task if self.launch == "srun" else self.cpus_per_task * self.procs

    @property
    def log_path(self) -> str:
        """``log_dir`` made absolute against ``workdir`` (SLURM resolves it the same way)."""
        return posixpath.normpath(posixpath.join(self.workdir, self.log_dir))


class ClusterProfile(Model):
    """A site's defaults, named by a spec (``profile: site``); any field left out stays unset.

    Every field has the meaning and checks of the ``JobSpec`` field of the same name.
    """

    name: Name = Field(description=_D_NAME)
    partition: Line | None = Field(None, description=_D_SLURM)
    account: Line | None = Field(None, description=_D_SLURM)
    qos: Line | None = Field(None, description=_D_SLURM)
    constraint: Line | None = Field(None, description=_D_SLURM)
    setup: Setup = Field(default_factory=list, description=_D_SETUP)
    env: EnvMap = Field(default_factory=dict, description=_D_ENV)
    host_template: HostTemplate | None = Field(None, description=_D_HOST)
    template: Line | None = Field(None, description=_D_TEMPLATE)
    sbatch: SbatchMap = Field(default_factory=dict, description=_D_SBATCH)
    python: Line | None = Field(None, description=_D_PYTHON)
    cpus_per_task: int | None = Field(None, ge=1, le=spec_checks.MAX_CPUS, description=_D_CPUS)
    cpus_per_node: int | None = Field(None, ge=1, le=spec_checks.MAX_CPUS, description=_D_CPUS_NODE)
    mem_gb: float | None = Field(
        None, gt=0, le=spec_checks.MAX_MEM_GB, allow_inf_nan=False, description=_D_MEM
    )
    time_min: int | None = Field(None, ge=1, le=spec_checks.MAX_TIME_MIN, description=_D_TIME)
    log_dir: Line | None = Field(None, description=_D_LOG)
    health_check: Line | None = Field(None, description=_D_HEALTH)
    health_check_timeout_s: int | None = Field(
        None, ge=1, le=24 * 3600, description=_D_HEALTH_TIMEOUT
    )
    max_excluded_nodes: int | None = Field(
        None, ge=0, le=spec_checks.MAX_NODES, description=_D_EXCLUDED
    )

    def defaults(self) -> dict[str, object]:
        """The spec fields this profile sets (those written in its file), ``name`` excluded."""
        return self.model_dump(exclude_unset=True, exclude={"name"})
