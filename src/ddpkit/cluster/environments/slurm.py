"""SLURM tasks started by ``srun``, and the batch script that was not.

Owns the reading of SLURM's variables; submitit's SLURM executor reuses
:func:`slurm_rank_info`. Step-level variables win over job-level ones: inside an allocation a
step may use fewer tasks or nodes than the job. Task placement comes from the step's
tasks-per-node layout (``3,1(x2)``), so uneven layouts give each node its own local world.

A batch script runs with ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` of the whole job but is a
single process (no step, or one of SLURM's pseudo steps): it becomes a ``single`` rank with a
note telling the user how to start the tasks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from ddpkit.cluster import validate
from ddpkit.cluster.environments.base import ClusterEnvironment
from ddpkit.cluster.environments.single import single_rank_info
from ddpkit.cluster.environments.torchenv import TorchEnvEnvironment
from ddpkit.cluster.envvars import (
    env_int,
    first_set,
    master_from_env,
    parse_int,
    require_int,
    require_set,
)
from ddpkit.cluster.nodelist import count_hosts, expand_tasks_per_node, first_host
from ddpkit.cluster.rankinfo import Launcher, RankInfo
from ddpkit.cluster.rendezvous.ports import PortSearch, step_search
from ddpkit.contract import HOST_TEMPLATE_VAR
from ddpkit.errors import ConfigError

__all__ = [
    "MPI_LAUNCHER_VARS",
    "SLURM_MAX_NORMAL_STEP_ID",
    "SlurmEnvironment",
    "SlurmLayout",
    "SlurmTask",
    "apply_host_template",
    "in_slurm_step",
    "read_layout",
    "slurm_rank_info",
    "slurm_task",
]

# slurm.h: ids above SLURM_MAX_NORMAL_STEP_ID (0xfffffff0) are pseudo steps. Slurm >= 20.11
# uses 0xfffffffa interactive, 0xfffffffb batch, 0xfffffffc extern, 0xfffffffd pending;
# older releases used 0xfffffffe batch and 0xffffffff extern. All of them are one process.
SLURM_MAX_NORMAL_STEP_ID = 0xFFFFFFF0


# Set by mpirun (Open MPI, MVAPICH, MPICH/Intel hydra) for the processes it starts. mpirun
# inside an allocation starts its own daemons through one srun task per node, so the SLURM
# variables its ranks inherit describe that daemon step, not the MPI ranks: MPI must win.
# (PMI_RANK/PMI_SIZE are not listed: srun --mpi=pmi2 sets them for real SLURM tasks too.)
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")

# Each field lists its variables by precedence: the step's own first, the job's as fallback
# (srun overwrites SLURM_NTASKS/SLURM_NNODES/SLURM_NODELIST/SLURM_TASKS_PER_NODE for its
# step; the SLURM_JOB_* ones keep describing the allocation).
_VARS: dict[str, tuple[str, ...]] = {
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "step_id": ("SLURM_STEP_ID", "SLURM_STEPID"),
    "rank": ("SLURM_PROCID",),
    "local_rank": ("SLURM_LOCALID",),
    "node_rank": ("SLURM_NODEID",),
    "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
    "num_nodes": ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
    "nodelist": ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"),
    "tasks_per_node": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
}
_HINT = "srun sets this for every task; start the tasks with `srun python ...`"


def _first_set(env: Mapping[str, str], field: str) -> tuple[str, str] | None:
    """(variable, value) of the first variable of ``field`` that is set."""
    return first_set(env, _VARS[field])


def _require(env: Mapping[str, str], field: str) -> tuple[str, str]:
    return require_set(env, _VARS[field], hint=_HINT)


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """True inside a real ``srun`` step (a step id that is not one of the pseudo steps)."""
    found = _first_set(env, "step_id")
    if found is None:
        return False
    step_id = parse_int(found[0], found[1], hint=_HINT)
    return 0 <= step_id <= SLURM_MAX_NORMAL_STEP_ID


@dataclass(frozen=True)
class SlurmLayout:
    """How a SLURM step spreads its tasks; ``names`` maps each field to the variable read."""

    num_tasks: int
    num_nodes: int
    tasks_per_node: tuple[int, ...]
    nodelist: str | None
    names: Mapping[str, str]


def read_layout(env: Mapping[str, str]) -> SlurmLayout:
    """The step's task/node counts and layout, cross-checked against each other."""
    names: dict[str, str] = {}
    counts: dict[str, int] = {}
    for field in ("world_size", "num_nodes"):
        name, value = _require(env, field)
        names[field], counts[field] = name, parse_int(name, value, hint=_HINT)
    validate.check_sizes(names=names, **counts)
    tpn_name, tpn_text = _require(env, "tasks_per_node")
    names["tasks_per_node"] = tpn_name
    tasks_per_node = expand_tasks_per_node(tpn_text, source=tpn_name)
    nodelist = _first_set(env, "nodelist")
    if nodelist is not None:
        names["nodelist"] = nodelist[0]
    validate.check_slurm_layout(
        tasks_var=names["world_size"],
        num_tasks=counts["world_size"],
        nodes_var=names["num_nodes"],
        num_nodes=counts["num_nodes"],
        tasks_per_node_var=tpn_name,
        tasks_per_node_text=tpn_text,
        tasks_per_node=tasks_per_node,
        nodelist_var=nodelist[0] if nodelist else "SLURM_STEP_NODELIST",
        nodelist_text=nodelist[1] if nodelist else "",
        num_hosts=count_hosts(nodelist[1], source=nodelist[0]) if nodelist else None,
    )
    return SlurmLayout(
        num_tasks=counts["world_size"],
        num_nodes=counts["num_nodes"],
        tasks_per_node=tuple(tasks_per_node),
        nodelist=nodelist[1] if nodelist else None,
        names=MappingProxyType(names),
    )


@dataclass(frozen=True)
class SlurmTask:
    """A task of a real srun step: its rank, its step's size, and its node's task count."""

    rank: int
    num_tasks: int
    tasks_on_node: int


def slurm_task(env: Mapping[str, str]) -> SlurmTask | None:
    """This srun task's place in its step, or None outside a real step.

    Used by other launchers running inside a step (torchrun) to check their own view.
    """
    if not in_slurm_step(env):
        return None
    rank, node_rank = (
        require_int(env, _VARS[field], hint=_HINT) for field in ("rank", "node_rank")
    )
    layout = read_layout(env)
    validate.check_index(
        _VARS["node_rank"][0], node_rank, layout.names["num_nodes"], layout.num_nodes
    )
    return SlurmTask(rank, layout.num_tasks, layout.tasks_per_node[node_rank])


def apply_host_template(env: Mapping[str, str], host: str) -> str:
    """``host`` through DDPKIT_HOST_TEMPLATE (e.g. ``{host}-ib``) when that is set."""
    template = env.get(HOST_TEMPLATE_VAR)
    if template is None:
        return host
    if "{host}" not in template:
        raise ConfigError(
            f"{HOST_TEMPLATE_VAR}={template!r} does not contain '{{host}}'",
            hint="write the master host name with a placeholder, e.g. '{host}-ib' or "
            "'{host}.ib.cluster'",
        )
    return template.replace("{host}", host)


def _port_search(env: Mapping[str, str]) -> PortSearch:
    """The step's reserved port (if any), then its derived candidates; see
    ddpkit.cluster.rendezvous.ports.step_search."""
    job_id = _require(env, "job_id")[1]
    found = _first_set(env, "step_id")
    step = None if found is None else found[1]
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return step_search(f"slurm job {job_id} step {step} restart {restarts}", job_id, step, env)


def _master(env: Mapping[str, str], layout: SlurmLayout) -> tuple[str, PortSearch | int]:
    """Rank 0's host, and its port: MASTER_PORT when set, else a search over candidates."""
    addr, port = master_from_env(env)
    if addr is None:
        if layout.nodelist is None:
            raise ConfigError(
                f"{' / '.join(_VARS['nodelist'])} is not set and neither is MASTER_ADDR",
                hint="srun sets SLURM_STEP_NODELIST; otherwise export MASTER_ADDR=<host of rank 0>",
            )
        source = layout.names["nodelist"]
        addr = apply_host_template(env, first_host(layout.nodelist, source=source))
    return addr, _port_search(env) if port is None else port


def _batch_rank_info(env: Mapping[str, str]) -> RankInfo:
    """A batch script (or salloc shell) without srun: one process; a note if more were asked."""
    ntasks = env_int(env, "SLURM_NTASKS", hint=_HINT)
    notes: tuple[str, ...] = ()
    if ntasks is not None and ntasks > 1:
        step = _first_set(env, "step_id")
        why = (
            "SLURM_STEP_ID is not set"
            if step is None
            else f"{step[0]}={step[1]} is SLURM's batch/extern/interactive pseudo step"
        )
        notes = (
            f"SLURM_NTASKS={ntasks} but this process was not started by srun ({why}), so it "
            "runs alone as rank 0 of 1 (hint: start the tasks with `srun python ...`, "
            "or use `ddpkit run`)",
        )
    return single_rank_info(env, notes)


def slurm_rank_info(env: Mapping[str, str], launcher: Launcher) -> RankInfo:
    """The RankInfo of a SLURM task (``launcher`` is "slurm", or "submitit" for its jobs)."""
    if not in_slurm_step(env):
        return _batch_rank_info(env)
    rank, local_rank, node_rank = (
        require_int(env, _VARS[field], hint=_HINT) for field in ("rank", "local_rank", "node_rank")
    )
    layout = read_layout(env)
    names = {field: variables[0] for field, variables in _VARS.items()} | dict(layout.names)
    # The node index must be checked before it picks this node's count from the layout.
    validate.check_index(names["node_rank"], node_rank, names["num_nodes"], layout.num_nodes)
    local_world_size = layout.tasks_per_node[node_rank]
    names["local_world_size"] = f"{names['tasks_per_node']}[{node_rank}]"
    # Not torchrun's (detected first), so RANK/WORLD_SIZE were exported by hand: torch's
    # env:// would read them instead of SLURM's values.
    validate.check_stray_torch_vars(
        stray_rank=env.get("RANK"),
        stray_world_size=env.get("WORLD_SIZE"),
        rank_var=names["rank"],
        rank=rank,
        world_size_var=names["world_size"],
        world_size=layout.num_tasks,
    )
    addr, port = _master(env, layout)
    search = port if isinstance(port, PortSearch) else None
    info = RankInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=layout.num_tasks,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=layout.num_nodes,
        master_addr=addr,
        master_port=port.ports[0] if isinstance(port, PortSearch) else port,
        launcher=launcher,
        port_search=search,
    )
    return validate.check_rank_info(info, names)


def _in_step_or_unreadable(env: Mapping[str, str]) -> bool:
    try:
        return in_slurm_step(env)
    except ConfigError:  # a bad step id: SLURM's rank_info names it
        return True


class SlurmEnvironment(ClusterEnvironment):
    """Detected by SLURM_PROCID and a job id, unless mpirun started the process."""

    launcher: ClassVar[Launcher] = "slurm"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        if any(name in env for name in MPI_LAUNCHER_VARS):
            return False
        if "SLURM_PROCID" not in env or _first_set(env, "job_id") is None:
            return False
        # Outside an srun step, SLURM's variables describe the batch script, not processes it
        # started itself with torch's env:// variables (mp.spawn, a hand-written loop): those
        # are an "env" job, not a single process each.
        return not TorchEnvEnvironment.detect(env) or _in_step_or_unreadable(env)

    def rank_info(self) -> RankInfo:
        return slurm_rank_info(self.env, self.launcher)
