"""The spec's binding fields: ``cpu_bind`` and ``gpu_bind``, srun's ``--cpu-bind`` and
``--gpu-bind`` for the job step's tasks (sbatch and submitit carry them; torchx refuses), and
``numa_binding``, torchrun's ``--numa-binding`` on each node's ``ddpkit run`` (``launch:
torchrun``: sbatch and torchx carry it).

A value is srun's own text (``cores``, ``map_cpu:0,2``, ``verbose,closest``), checked for a
keyword srun knows and for characters srun's values use, so none can add an option or a line
to the script; a ``map_cpu``/``mask_cpu`` list entry by entry, and against ``cpus_per_node``
where the spec or its profile gives it (:mod:`ddpkit.jobs.bind_cpus`). The binding happens on
nodes whose task plugin binds (``TaskPlugin=task/affinity`` or ``task/cgroup``). ``ddpkit
plan`` shows each local rank's CPUs where the value alone decides them (a map, a mask,
``rank`` with one CPU per task), and otherwise what srun picks.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator

from ddpkit.jobs.bind_cpus import check_list, check_node_cpus, split_value
from ddpkit.jobs.spec_checks import invalid, shown

__all__ = [
    "BIND_DOCS",
    "CpuBind",
    "GpuBind",
    "NumaBinding",
    "check_binding",
    "numa_flag",
    "srun_binding",
]

NumaBinding = Literal["node", "socket", "exclusive", "core-complex"]  # torchrun's modes

BIND_DOCS = {
    "cpu_bind": "srun's --cpu-bind for each task, e.g. cpu_bind: cores (sbatch, submitit)",
    "gpu_bind": "srun's --gpu-bind for each task, e.g. gpu_bind: closest (sbatch, submitit)",
    "numa_binding": "launch: torchrun: torchrun's --numa-binding on each node's ddpkit run "
    "(node, socket, exclusive, core-complex; torch 2.9+), e.g. numa_binding: node",
}
# srun(1): the keywords of --cpu-bind and --gpu-bind (the second one's "verbose," prefix too)
_CPU_KEYWORDS = frozenset({
    "none", "no", "rank", "map_cpu", "mask_cpu", "rank_ldom", "map_ldom", "mask_ldom",
    "sockets", "cores", "threads", "ldoms", "boards",
})  # fmt: skip
_GPU_KEYWORDS = frozenset({"closest", "map_gpu", "mask_gpu", "none", "per_task", "single"})
# what srun's values are made of: keywords, ':' and ',' lists of numbers and masks, '*' counts
_VALUE = re.compile(r"[a-z_]+(?::[0-9A-Fa-fx,*]+)?")


def _checked(value: str, keywords: frozenset[str], example: str) -> str:
    keyword, items = split_value(value)
    if not _VALUE.fullmatch(keyword if items is None else f"{keyword}:{items}"):
        raise invalid(f"has {shown(value)}, not a value srun takes", example)
    if keyword not in keywords:
        known = ", ".join(sorted(keywords))
        raise invalid(f"has {shown(keyword)}, which srun does not know ({known})", example)
    return value


def _check_cpu_bind(value: str) -> str:
    _checked(value, _CPU_KEYWORDS, "e.g. cpu_bind: cores, or cpu_bind: map_cpu:0,4")
    check_list(value)
    return value


def _check_gpu_bind(value: str) -> str:
    return _checked(value, _GPU_KEYWORDS, "e.g. gpu_bind: closest, or gpu_bind: single:1")


CpuBind = Annotated[str, AfterValidator(_check_cpu_bind)]
GpuBind = Annotated[str, AfterValidator(_check_gpu_bind)]


def srun_binding(cpu_bind: str | None, gpu_bind: str | None) -> list[str]:
    """srun's options for the job step (none for null)."""
    options = [] if cpu_bind is None else [f"--cpu-bind={cpu_bind}"]
    return options + ([] if gpu_bind is None else [f"--gpu-bind={gpu_bind}"])


def check_binding(
    cpu_bind: str | None, cpus_per_node: int | None, numa_binding: str | None, launch: str
) -> None:
    """The binding fields against the rest of the spec: ``numa_binding`` is torchrun's (``ddpkit
    run``'s) flag, which nothing carries under ``launch: srun`` (srun's own binding is
    ``cpu_bind``); a map or mask names only CPUs a node has."""
    if numa_binding is not None and launch != "torchrun":
        raise invalid(
            "is torchrun's --numa-binding, for launch: torchrun; under launch: srun each task "
            "is bound by srun",
            "set launch: torchrun, or use cpu_bind (e.g. cpu_bind: ldoms)",
            field="numa_binding",
            value=numa_binding,
        )
    check_node_cpus(cpu_bind, cpus_per_node)


def numa_flag(numa_binding: str | None) -> list[str]:
    """``ddpkit run``'s ``--numa-binding MODE`` (none for null)."""
    return [] if numa_binding is None else ["--numa-binding", numa_binding]
