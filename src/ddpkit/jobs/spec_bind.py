"""The spec's binding fields: ``cpu_bind`` and ``gpu_bind``, srun's ``--cpu-bind`` and
``--gpu-bind`` for the job step's tasks (sbatch and submitit carry them; torchx refuses).

A value is srun's own text (``cores``, ``map_cpu:0,2``, ``verbose,closest``), checked for a
keyword srun knows and for characters srun's values use, so none can add an option or a line
to the script. Which CPUs each rank then gets is srun's decision, on nodes whose task plugin
binds (``TaskPlugin=task/affinity`` or ``task/cgroup``); ``ddpkit plan`` says the option, not
the CPUs.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

from ddpkit.jobs.spec_checks import invalid, shown

__all__ = ["BIND_DOCS", "CpuBind", "GpuBind", "srun_binding"]

BIND_DOCS = {
    "cpu_bind": "srun's --cpu-bind for each task, e.g. cpu_bind: cores (sbatch, submitit)",
    "gpu_bind": "srun's --gpu-bind for each task, e.g. gpu_bind: closest (sbatch, submitit)",
}
# srun(1): the keywords of --cpu-bind and --gpu-bind (the second one's "verbose," prefix too)
_CPU_KEYWORDS = frozenset({
    "none", "no", "rank", "map_cpu", "mask_cpu", "rank_ldom", "map_ldom", "mask_ldom",
    "sockets", "cores", "threads", "ldoms", "boards",
})  # fmt: skip
_GPU_KEYWORDS = frozenset({"closest", "map_gpu", "mask_gpu", "none", "per_task", "single"})
_PREFIXES = ("verbose,", "quiet,", "v,", "q,")
# what srun's values are made of: keywords, ':' and ',' lists of numbers and masks, '*' counts
_VALUE = re.compile(r"[a-z_]+(?::[0-9A-Fa-fx,*]+)?")


def _checked(value: str, keywords: frozenset[str], example: str) -> str:
    rest = value
    while rest.startswith(_PREFIXES):
        rest = rest.partition(",")[2]
    if not _VALUE.fullmatch(rest):
        raise invalid(f"has {shown(value)}, not a value srun takes", example)
    keyword = rest.partition(":")[0]
    if keyword not in keywords:
        known = ", ".join(sorted(keywords))
        raise invalid(f"has {shown(keyword)}, which srun does not know ({known})", example)
    return value


def _check_cpu_bind(value: str) -> str:
    return _checked(value, _CPU_KEYWORDS, "e.g. cpu_bind: cores, or cpu_bind: map_cpu:0,4")


def _check_gpu_bind(value: str) -> str:
    return _checked(value, _GPU_KEYWORDS, "e.g. gpu_bind: closest, or gpu_bind: single:1")


CpuBind = Annotated[str, AfterValidator(_check_cpu_bind)]
GpuBind = Annotated[str, AfterValidator(_check_gpu_bind)]


def srun_binding(cpu_bind: str | None, gpu_bind: str | None) -> list[str]:
    """srun's options for the job step (none for null)."""
    options = [] if cpu_bind is None else [f"--cpu-bind={cpu_bind}"]
    return options + ([] if gpu_bind is None else [f"--gpu-bind={gpu_bind}"])
