"""Cross-checks of a launcher's variables, before anything can hang on a bad topology.

Pure functions over plain values (so they are table-testable); each raises ``TopologyError``
naming the variables involved and their values, with a hint. The environments call them from
``rank_info()`` after reading their variables.
"""

from __future__ import annotations

from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.contract import EXPECTED_WORLD_SIZE_VAR, JOB_LAUNCH_VAR
from ddpkit.errors import TopologyError

__all__ = [
    "check_expected_world_size",
    "check_index",
    "check_rank_info",
    "check_sizes",
    "check_slurm_layout",
    "check_stray_torch_vars",
    "check_torchrun_in_slurm",
]


_HINT = "these variables are set by the launcher; do not override them by hand"


def check_sizes(*, names: dict[str, str], **sizes: int) -> None:
    """Every size (``world_size=4, local_world_size=2, ...``) is at least 1.

    ``names`` maps the field names to the variables they were read from, so the message names
    what the user can see in their environment. Call it before dividing by a size.
    """
    for field, size in sizes.items():
        if size < 1:
            raise TopologyError(f"{names.get(field, field)}={size} must be at least 1", hint=_HINT)


def check_index(name: str, value: int, size_name: str, size: int) -> None:
    """``value`` (read from ``name``) lies in [0, ``size``) (read from ``size_name``)."""
    if not 0 <= value < size:
        raise TopologyError(f"{name}={value} is outside [0, {size_name}={size})", hint=_HINT)


def check_rank_info(info: RankInfo, names: dict[str, str]) -> RankInfo:
    """``info`` when every size is positive and every index lies inside its size; ``names``
    maps its fields to the variables they were read from (see :func:`check_sizes`)."""
    check_sizes(
        names=names,
        world_size=info.world_size,
        local_world_size=info.local_world_size,
        num_nodes=info.num_nodes,
    )
    if info.local_world_size > info.world_size:
        raise TopologyError(
            f"{names.get('local_world_size', 'local_world_size')}={info.local_world_size} "
            f"exceeds {names.get('world_size', 'world_size')}={info.world_size}",
            hint=_HINT,
        )
    for field, size_field in (
        ("rank", "world_size"),
        ("local_rank", "local_world_size"),
        ("node_rank", "num_nodes"),
    ):
        value, size = getattr(info, field), getattr(info, size_field)
        check_index(names.get(field, field), value, names.get(size_field, size_field), size)
    return info


def check_slurm_layout(
    *,
    tasks_var: str,
    num_tasks: int,
    nodes_var: str,
    num_nodes: int,
    tasks_per_node_var: str,
    tasks_per_node_text: str,
    tasks_per_node: list[int],
    nodelist_var: str,
    nodelist_text: str,
    num_hosts: int | None,
) -> None:
    """SLURM's task and node counts agree with its tasks-per-node layout and its nodelist.

    ``num_hosts`` is None when no nodelist was available (then it is not checked).
    """
    hint = (
        "SLURM's step variables contradict each other; was one of them exported by hand "
        "or inherited from another step? unset the SLURM_* variables you set yourself"
    )
    total = sum(tasks_per_node)
    if total != num_tasks:
        raise TopologyError(
            f"{tasks_per_node_var}={tasks_per_node_text!r} adds up to {total} tasks but "
            f"{tasks_var}={num_tasks}",
            hint=hint,
        )
    if len(tasks_per_node) != num_nodes:
        raise TopologyError(
            f"{tasks_per_node_var}={tasks_per_node_text!r} describes {len(tasks_per_node)} "
            f"nodes but {nodes_var}={num_nodes}",
            hint=hint,
        )
    if num_hosts is not None and num_hosts != num_nodes:
        raise TopologyError(
            f"{nodelist_var}={nodelist_text!r} names {num_hosts} hosts but {nodes_var}={num_nodes}",
            hint=hint,
        )


def check_torchrun_in_slurm(
    *,
    srun_tasks_on_node: int,
    nproc_per_node: int,
    torchrun_rank: int,
    torchrun_world_size: int,
    slurm_procid: int,
    slurm_num_tasks: int,
) -> None:
    """torchrun inside a SLURM step must be the only srun task on its node.

    srun starting N tasks on a node, each running ``torchrun --nproc-per-node M``, makes N*M
    processes that claim the same local ranks and GPUs (Lightning#20391). A launcher that only
    copies SLURM's view into RANK/WORLD_SIZE (same rank, same world size) is not torchrun
    nesting and passes.
    """
    mirrors_slurm = torchrun_rank == slurm_procid and torchrun_world_size == slurm_num_tasks
    if srun_tasks_on_node > 1 and nproc_per_node > 1 and not mirrors_slurm:
        raise TopologyError(
            f"srun started {srun_tasks_on_node} tasks on this node (SLURM_STEP_TASKS_PER_NODE) "
            f"and each runs torchrun with nproc {nproc_per_node} (LOCAL_WORLD_SIZE="
            f"{nproc_per_node}) → duplicate ranks / GPUs",
            hint=(
                "run one torchrun per node (`srun --ntasks-per-node=1 torchrun "
                "--nproc-per-node M ...`), or drop torchrun and let srun start one task per "
                "process (`srun --ntasks-per-node=M python ...`)"
            ),
        )


def check_stray_torch_vars(
    *,
    stray_rank: str | None,
    stray_world_size: str | None,
    rank_var: str,
    rank: int,
    world_size_var: str,
    world_size: int,
) -> None:
    """RANK / WORLD_SIZE left in the environment must agree with the launcher's own view.

    Outside torchrun these are usually exported by hand in a job script; torch.distributed's
    ``env://`` reads them, so a contradicting value would silently build a different group.
    """
    for stray_name, stray, own_name, own in (
        ("WORLD_SIZE", stray_world_size, world_size_var, world_size),
        ("RANK", stray_rank, rank_var, rank),
    ):
        if stray is not None and stray.strip() != str(own):
            raise TopologyError(
                f"{stray_name}={stray!r} contradicts {own_name}={own}",
                hint=f"unset {stray_name} (ddpkit reads {own_name} from the launcher)",
            )


def _expected_world_size_hint(launcher: str, job_launch: str | None) -> str:
    """What most likely went wrong, given who started us and what the spec asked for."""
    if job_launch == "srun" and launcher == "single":
        return (
            "the job spec says launch: srun — start the tasks with srun (the generated script "
            "does), not `python` directly in the batch script"
        )
    if job_launch == "torchrun" and launcher != "torchrun":
        return (
            "the job spec says launch: torchrun — each node's task must start its workers "
            "through `python -m ddpkit run` (the generated script does), not `python` directly"
        )
    return (
        "the job started a different number of processes than its spec asks for "
        "(nodes × procs_per_node, the nodes of this attempt for nodes: MIN-MAX): were the srun "
        "options or the allocation changed by hand? "
        f"for a deliberately smaller step (e.g. `srun -n1` preprocessing) unset "
        f"{EXPECTED_WORLD_SIZE_VAR} for that step"
    )


def check_expected_world_size(
    *, expected: int, world_size: int, launcher: str, job_launch: str | None
) -> None:
    """The detected world size equals the one the job spec asked for.

    ``expected`` comes from DDPKIT_EXPECTED_WORLD_SIZE, ``job_launch`` from DDPKIT_JOB_LAUNCH
    (None when unset); both are exported by ddpkit's job scripts. Catches the quiet failure of a
    ``launch: srun`` spec whose script runs ``python train.py`` without srun: SLURM then gives
    one process that would train alone as rank 0 of 1.
    """
    if expected != world_size:
        spec = "" if job_launch is None else f", {JOB_LAUNCH_VAR}={job_launch}"
        raise TopologyError(
            f"{EXPECTED_WORLD_SIZE_VAR}={expected}{spec} but the {launcher} launcher started "
            f"a world of {world_size} process{'es' if world_size != 1 else ''}",
            hint=_expected_world_size_hint(launcher, job_launch),
        )
