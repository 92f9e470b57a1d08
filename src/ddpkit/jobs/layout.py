"""The rank layout of a job spec, and ``ddpkit plan``'s text: pure, no SLURM.

Ranks are node-major in both launch modes, so one table describes both:

- ``launch: srun`` asks for ``procs`` tasks per node; SLURM's default block distribution gives
  node *n* the tasks ``n*procs .. n*procs+procs-1`` (SLURM_PROCID), SLURM_LOCALID counting from
  0 on each node. (``sbatch: {distribution: ...}`` is refused by the spec for that reason.)
- ``launch: torchrun`` runs one torchrun per node; it gives its workers
  ``rank = node_rank*procs + local_rank``. With the c10d rendezvous the node rank follows the
  order in which nodes join, so the host behind ``node1`` is known only at run time.

Host names are placeholders (``node0``, ...): SLURM picks the hosts. The plan masks secrets
(:mod:`ddpkit.masking`: plans get pasted into issues); ``submit --dry-run`` does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ddpkit.jobs.bind_cpus import plan_line as cpus_line
from ddpkit.jobs.spec import JobSpec
from ddpkit.jobs.spec_bind import srun_binding
from ddpkit.jobs.spec_checks import shown
from ddpkit.jobs.spec_container import plan_line
from ddpkit.masking import mask, mask_tree

__all__ = [
    "PLAN_ROWS",
    "LayoutRow",
    "format_layout",
    "format_plan",
    "format_runs",
    "format_table",
    "profile_line",
    "rank_layout",
]

_COLUMNS = ("node", "host", "local_rank", "rank", "device")
PLAN_ROWS = 64


@dataclass(frozen=True)
class LayoutRow:
    """One process of the job: where it runs and which ranks and device it gets."""

    node: int  # node index (torchrun: the node rank)
    host: str  # placeholder name, "node<index>"
    local_rank: int
    rank: int
    device: str  # "cuda:<local_rank>" on GPU nodes, else "cpu"


def _row(spec: JobSpec, rank: int) -> LayoutRow:
    node, local = divmod(rank, spec.procs)
    device = f"cuda:{local}" if spec.gpus_per_node > 0 else "cpu"
    return LayoutRow(node=node, host=f"node{node}", local_rank=local, rank=rank, device=device)


def rank_layout(spec: JobSpec) -> list[LayoutRow]:
    """Every process of ``spec``, ordered by global rank (``world_size`` rows: for a big job,
    :func:`format_plan` shows only the first and last)."""
    return [_row(spec, rank) for rank in range(spec.world_size)]


def _plan_table(spec: JobSpec) -> str:
    """The layout table of ``plan``: every rank up to :data:`PLAN_ROWS` of them, else the
    first and last ``PLAN_ROWS // 2`` around a line saying what is left out (a job of 100000
    nodes must not become a table of millions of rows)."""
    world = spec.world_size
    if world <= PLAN_ROWS:
        return format_layout(rank_layout(spec))
    half = PLAN_ROWS // 2
    rows = [_row(spec, rank) for rank in (*range(half), *range(world - half, world))]
    lines = format_layout(rows).splitlines()
    lines.insert(
        1 + half,
        f"... ranks {half}-{world - half - 1} not shown (rank = node * {spec.procs} + local_rank)",
    )
    return "\n".join(lines)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A table with aligned columns, the header line first (no trailing spaces)."""
    cells = [header, *rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def format_layout(rows: list[LayoutRow]) -> str:
    """``rows`` as a table with aligned columns, a header line first."""
    return format_table(
        list(_COLUMNS), [[str(getattr(row, column)) for column in _COLUMNS] for row in rows]
    )


def format_runs(spec: JobSpec) -> str:
    """A sweep's runs, one line per array task: index, each value, the run's folder name."""
    if spec.sweep is None:
        return ""
    names = list(spec.sweep.params)
    rows = [
        [str(task.index), *(task.values[name] for name in names), task.run]
        for task in spec.sweep.tasks
    ]
    return format_table(["task", *names, "run"], rows)


def profile_line(spec: JobSpec, profile_path: Path) -> str:
    """The line saying which file the spec's profile was read from (plan prints it as a YAML
    comment, submit on stderr): a profile's ``setup:`` lines run in the job."""
    return f"profile {shown(spec.profile)} read from {profile_path}"


_AFTER_MEANS = {"afterok": "once every one has COMPLETED", "afterany": "once every one has ended"}


def _chain_lines(spec: JobSpec) -> str:
    """What ``after``/``singleton``/``log_ranks``/``snapshot`` do, in words (names are resolved
    to job ids at submission; ``--dry-run`` shows the ids and the snapshot's folder)."""
    lines = []
    if spec.after:
        jobs = ", ".join(spec.after)
        lines.append(
            f"# chain: starts after {jobs} ({spec.after_type}: {_AFTER_MEANS[spec.after_type]})"
        )
    if spec.singleton:
        lines.append(f"# singleton: one job named {spec.name} of yours runs at a time")
    if spec.log_ranks is not None:
        shown = ",".join(map(str, spec.log_ranks))
        lines.append(f"# console: each node's output shows local rank(s) {shown} only")
    if spec.cpu_bind is not None or spec.gpu_bind is not None:
        options = " ".join(srun_binding(spec.cpu_bind, spec.gpu_bind))
        gpus = " (srun picks each task's GPUs)" if spec.gpu_bind is not None else ""
        lines.append(f"# binding: srun {options}{gpus}")
    if spec.cpu_bind is not None:
        workers = spec.procs if spec.launch == "torchrun" else 1
        lines.append(
            cpus_line(spec.cpu_bind, spec.tasks_per_node, spec.cpus_per_slurm_task, workers)
        )
    if spec.numa_binding is not None:
        lines.append(
            f"# binding: ddpkit run --numa-binding {spec.numa_binding} (torch's agent binds each "
            "worker to CPUs near its GPU)"
        )
    container = plan_line(spec.container, spec.python)
    if container is not None:
        lines.append(container)
    if spec.snapshot:
        lines.append(
            f"# snapshot: the files git tracks under {spec.workdir} are copied to "
            f"{spec.log_path}/snapshots/ at submission; the job and its requeues run from there"
        )
    return "".join(f"\n{line}" for line in lines) + ("\n" if lines else "")


def format_plan(spec: JobSpec, profile_path: Path | None = None) -> str:
    """The resolved spec as YAML (every field, defaults filled in, credentials masked) and its
    rank layout; with ``profile_path``, a comment line naming the profile file first."""
    dumped = mask_tree(spec.model_dump())
    dumped["env"] = {name: mask(name, value) for name, value in spec.env.items()}
    dumped["nodes"] = spec.nodes if spec.min_nodes is None else spec.node_range  # as written
    del dumped["min_nodes"]  # not a key: nodes: MIN-MAX sets it
    resolved = yaml.safe_dump(dumped, sort_keys=False, default_flow_style=False, allow_unicode=True)
    if profile_path is not None:
        resolved = f"# {profile_line(spec, profile_path)}\n{resolved}"
    tasks = "one SLURM task per process" if spec.launch == "srun" else "one torchrun per node"
    ranged = spec.min_nodes is not None
    world = f"{spec.min_world_size}-{spec.world_size}" if ranged else str(spec.world_size)
    summary = (
        f"# rank layout: {spec.node_range} node(s) x {spec.procs} process(es) = world size "
        f"{world} (launch: {spec.launch}, {tasks})"
    )
    if ranged:
        summary += (
            f"\n# nodes {spec.node_range}: each attempt (a requeue too) runs on as many nodes as "
            f"SLURM gives it; on k nodes the ranks are the first k x {spec.procs} rows below"
        )
    text = f"# resolved job spec\n{resolved}\n{summary}\n{_plan_table(spec)}\n"
    text += _chain_lines(spec)
    if spec.sweep is not None:
        sweep = spec.sweep
        limit = f", at most {sweep.max_parallel} at once" if sweep.max_parallel else ""
        text += (
            f"\n# sweep: {sweep.count} runs ({sweep.mode}{limit}), one SLURM array task each, "
            f"every one with the layout above; logs in {spec.log_path}/<run>/\n"
            f"{format_runs(spec)}\n"
        )
    return text
