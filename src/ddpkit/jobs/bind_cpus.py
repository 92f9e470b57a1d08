"""Which CPUs srun's ``--cpu-bind`` gives the tasks of a node, where the value alone decides:
``ddpkit plan``'s ``# cpus`` line, the checks of a map or mask list, and the check of the CPUs
it names against ``cpus_per_node``. Pure: nothing here asks SLURM or the machine.

What srun(1) and its task plugin (task/affinity) do with each value, task *i* being the task
with SLURM_LOCALID *i* on its node, the same on every node:

- ``map_cpu:<list>``: task *i* is bound to the one CPU ``list[i % len(list)]`` (more tasks
  than entries start the list over). IDs are decimal, or hex after ``0x`` (srun(1); some srun
  releases take decimal only).
- ``mask_cpu:<list>``: task *i* to the CPUs of mask ``list[i % len(list)]``, always hex, ``0x``
  optional.
- In both lists ``X*N`` stands for N copies of X (``map_cpu:0*2,1*2`` is ``0,0,1,1``); srun
  expands them before the wrap. The IDs are the node's own CPU numbers (the kernel's).
- ``rank``: task *i* to CPU *i*; decided here only with one CPU per task (srun takes it on a
  whole node only).
- Every other value is srun's choice among the CPUs of the step on that node: ``cores`` and
  ``threads`` give each task its ``cpus_per_task`` CPUs (whole cores for ``cores``), ``sockets``,
  ``ldoms`` and ``boards`` whole ones of those, the ``*_ldom`` values the CPUs of NUMA domains
  (which CPUs those hold is the node's layout); ``none`` binds nothing.

``verbose,``/``quiet,`` prefixes change what srun logs, not the CPUs. What plan cannot know:
whether the nodes bind at all (their ``TaskPlugin``), and whether the CPUs a map or mask names
are in the step's allocation on the node (srun(1): explicit maps and masks are honoured only
there; with ``sbatch: {exclusive: true}`` the whole node is).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from ddpkit.jobs.spec_checks import MAX_CPUS, MAX_PER_NODE, invalid, shown

__all__ = [
    "LISTED",
    "PREFIXES",
    "NodeCpus",
    "check_list",
    "check_node_cpus",
    "cpu_list",
    "format_cpus",
    "node_cpus",
    "plan_line",
    "rank_items",
    "split_value",
]

PREFIXES = ("verbose,", "quiet,", "v,", "q,")  # srun's: what it logs, not where tasks run
LISTED = frozenset({"map_cpu", "mask_cpu", "map_ldom", "mask_ldom"})  # the keywords with a list
_MAP_ITEM = re.compile(r"(0x[0-9A-Fa-f]+|[0-9]+)(?:\*([0-9]+))?")
_MASK_ITEM = re.compile(r"(?:0x)?([0-9A-Fa-f]+)(?:\*([0-9]+))?")
_LIST_EXAMPLE = "e.g. cpu_bind: map_cpu:0,4, mask_cpu:0x3,0xc or map_cpu:0*2,1*2"
# what srun does where the value alone does not decide, per keyword ({cpus}: per task)
_CHOICE = {
    "cores": "srun's choice: each task gets the whole cores of its {cpus} ({cpus} where a core "
    "has one thread)",
    "threads": "srun's choice: each task gets {cpus} (threads)",
    "sockets": "srun's choice: each task gets the whole sockets of its CPUs",
    "ldoms": "srun's choice: each task gets the whole NUMA domains of its CPUs",
    "boards": "srun's choice: each task gets the whole boards of its CPUs",
    "rank": "srun's choice: each task is bound by its rank; with {cpus} per task srun(1) "
    "does not say to which",
    "rank_ldom": "the node's layout: task i gets the CPUs of NUMA domain i",
    "map_ldom": "the node's layout: each task gets the CPUs of the NUMA domain the list names",
    "mask_ldom": "the node's layout: each task gets the CPUs of the NUMA domains its mask names",
    "none": "not bound: each task may use every CPU of its step on the node",
}
_CHOICE["no"] = _CHOICE["none"]


def split_value(value: str) -> tuple[str, str | None]:
    """A ``cpu_bind`` value's keyword and list, prefixes dropped: ``("map_cpu", "1,0")`` for
    ``verbose,map_cpu:1,0``, ``("cores", None)`` for ``cores``."""
    rest = value
    while rest.startswith(PREFIXES):
        rest = rest.partition(",")[2]
    keyword, colon, items = rest.partition(":")
    return keyword, (items if colon else None)


def _entry(keyword: str, item: str) -> tuple[frozenset[int], int]:
    """One entry of a map or mask list: its CPUs and its repeat count."""
    found = (_MAP_ITEM if keyword == "map_cpu" else _MASK_ITEM).fullmatch(item)
    if found is None:
        what = "CPU IDs (decimal, or hex after 0x)" if keyword == "map_cpu" else "hex masks"
        raise invalid(f"has {shown(item)} in its list: {keyword} takes {what}", _LIST_EXAMPLE)
    text, count = found.group(1), found.group(2)
    if keyword == "map_cpu":
        if len(text) > 16:  # far past any CPU (and int() caps a long decimal's digits)
            raise invalid(f"has {shown(item)}: no node has that many CPUs", _LIST_EXAMPLE)
        cpus = frozenset({int(text, 16) if text.startswith("0x") else int(text)})
    else:
        mask = int(text, 16)  # a power-of-two base: no cap on the digits, and linear
        if mask.bit_length() > MAX_CPUS:
            raise invalid(f"has {shown(item)}: no node has that many CPUs", _LIST_EXAMPLE)
        cpus = frozenset(bit for bit in range(mask.bit_length()) if mask >> bit & 1)
        if not cpus:
            raise invalid(f"has the mask {shown(item)}, which names no CPU", _LIST_EXAMPLE)
    if max(cpus) >= MAX_CPUS:
        limit = f"a node has at most {MAX_CPUS} CPUs (0-{MAX_CPUS - 1})"
        raise invalid(f"names CPU {max(cpus)}: {limit}", _LIST_EXAMPLE)
    repeat = 1 if count is None else int(count) if len(count) <= 6 else 0
    if not 1 <= repeat <= MAX_PER_NODE:
        raise invalid(
            f"has {shown(item)}: a repeat count is 1 to {MAX_PER_NODE} (the tasks of a node)",
            _LIST_EXAMPLE,
        )
    return cpus, repeat


def cpu_list(keyword: str, items: str) -> list[tuple[frozenset[int], int]]:
    """``map_cpu``'s or ``mask_cpu``'s list as (CPUs, repeat count) entries, in order; a
    validation error (:func:`~ddpkit.jobs.spec_checks.invalid`) for an entry srun would refuse
    or read as something else."""
    if any(not item for item in items.split(",")):
        raise invalid(f"has an empty entry in its list {shown(items)}", _LIST_EXAMPLE)
    return [_entry(keyword, item) for item in items.split(",")]


def check_list(value: str) -> None:
    """A list where srun wants one (``map_cpu:`` ...), none after other keywords, and a map or
    mask list of entries srun reads as written."""
    keyword, items = split_value(value)
    if keyword in LISTED and not items:
        raise invalid(f"has no list after {keyword}", f"e.g. cpu_bind: {keyword}:0,1")
    if keyword not in LISTED and items is not None:
        raise invalid(f"has a list after {keyword}, which takes none", "e.g. cpu_bind: cores")
    if keyword in ("map_cpu", "mask_cpu") and items:
        cpu_list(keyword, items)


def check_node_cpus(cpu_bind: str | None, cpus_per_node: int | None) -> None:
    """A map or mask names only CPUs a node has (0 to ``cpus_per_node - 1``), where the spec
    or its profile says how many that is."""
    if cpu_bind is None or cpus_per_node is None:
        return
    keyword, items = split_value(cpu_bind)
    if keyword not in ("map_cpu", "mask_cpu") or not items:
        return
    highest = max(max(cpus) for cpus, _ in cpu_list(keyword, items))
    if highest >= cpus_per_node:
        raise invalid(
            f"names CPU {highest}, but a node has cpus_per_node={cpus_per_node} (CPUs 0-"
            f"{cpus_per_node - 1})",
            f"srun binds to the node's own CPU IDs: use IDs below {cpus_per_node}, or fix "
            "cpus_per_node, the spec's or its profile's",
            field="cpu_bind",
            value=cpu_bind,
        )


@dataclass(frozen=True)
class NodeCpus:
    """What a ``cpu_bind`` value says about the CPUs of one node's tasks (every node alike)."""

    tasks: tuple[frozenset[int], ...] | None  # task i's CPUs where the value decides, else None
    period: int  # a map's or mask's length after X*N (task i gets entry i % period); else 0
    choice: str  # where it does not decide: what srun does, in words; else ""


def node_cpus(cpu_bind: str, tasks_per_node: int, cpus_per_task: int) -> NodeCpus:
    """The CPUs of each of ``tasks_per_node`` tasks of a node (``cpus_per_task`` CPUs each, as
    SLURM counts them) under ``cpu_bind`` (a value the spec accepted): see the module."""
    keyword, items = split_value(cpu_bind)
    if keyword in ("map_cpu", "mask_cpu") and items:
        entries = cpu_list(keyword, items)
        ends = list(accumulate(count for _, count in entries))
        tasks = tuple(entries[bisect_right(ends, i % ends[-1])][0] for i in range(tasks_per_node))
        return NodeCpus(tasks, ends[-1], "")
    if keyword == "rank" and cpus_per_task == 1:
        return NodeCpus(tuple(frozenset({i}) for i in range(tasks_per_node)), 0, "")
    cpus = f"{cpus_per_task} CPU{'s' if cpus_per_task > 1 else ''}"
    return NodeCpus(None, 0, _CHOICE[keyword].format(cpus=cpus))


def format_cpus(cpus: frozenset[int]) -> str:
    """CPU IDs as the kernel writes a CPU list: ``0-3,8``."""
    ordered, spans = sorted(cpus), []
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(spans)


def _run_end(tasks: Sequence[frozenset[int]], i: int, in_order: bool) -> int:
    """The end (exclusive) of the run starting at task ``i``: tasks with the same CPUs, or
    (``in_order``) one CPU each, one more than the task before."""
    j = i + 1
    if in_order:
        while len(tasks[i]) == 1 and j < len(tasks) and tasks[j] == {min(tasks[i]) + j - i}:
            j += 1
    else:
        while j < len(tasks) and tasks[j] == tasks[i]:
            j += 1
    return j


def rank_items(tasks: Sequence[frozenset[int]]) -> list[str]:
    """``local rank 0 -> 1`` per task, runs of three or more as one item: ``local ranks 0-7
    in order -> 0-7`` (one CPU each) or ``local ranks 0-3 each -> 0-3`` (the same CPUs)."""
    items, i = [], 0
    while i < len(tasks):
        same, ordered = _run_end(tasks, i, False), _run_end(tasks, i, True)
        j = max(same, ordered)
        if j - i < 3:
            items.append(f"local rank {i} -> {format_cpus(tasks[i])}")
            i += 1
            continue
        if same >= ordered:
            items.append(f"local ranks {i}-{j - 1} each -> {format_cpus(tasks[i])}")
        else:
            first, last = min(tasks[i]), min(tasks[j - 1])
            items.append(f"local ranks {i}-{j - 1} in order -> {first}-{last}")
        i = j
    return items


def plan_line(cpu_bind: str, tasks_per_node: int, cpus_per_task: int, workers: int) -> str:
    """``ddpkit plan``'s ``# cpus`` line: each local rank's CPUs, or what srun picks. With one
    task per node hosting ``workers`` processes (``launch: torchrun``), that task's."""
    found = node_cpus(cpu_bind, tasks_per_node, cpus_per_task)
    if found.tasks is None:
        hosts = f" (a task: ddpkit run and its {workers} workers)" if workers > 1 else ""
        return f"# cpus on each node: {found.choice}{hosts}"
    if workers > 1:
        task = f"the node's one task (ddpkit run and its {workers} workers)"
        return f"# cpus on each node: {task} -> {format_cpus(found.tasks[0])}"
    shown_tasks = found.tasks[: found.period or None]
    line = "# cpus on each node: " + ", ".join(rank_items(shown_tasks))
    if len(found.tasks) > len(shown_tasks):
        period, last = found.period, len(found.tasks) - 1
        line += f"; local ranks {period}-{last} start the list over (rank i as i mod {period})"
    return line
