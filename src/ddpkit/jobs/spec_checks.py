"""What every spec model shares: the error type ``ddpkit.jobs.load`` reads, one-value checks, the
upper bounds of numeric fields, and :func:`shown`, how an error message quotes a bad value.

Split from :mod:`ddpkit.jobs.spec` so that the sweep's model (:mod:`ddpkit.jobs.sweep_spec`)
uses the same pieces without an import cycle.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

__all__ = [
    "ERROR_TYPE",
    "LIMIT_HINTS",
    "MAX_CPUS",
    "MAX_MEM_GB",
    "MAX_NODES",
    "MAX_PER_NODE",
    "MAX_REQUEUES",
    "MAX_TIME_MIN",
    "SHOWN_CHARS",
    "Model",
    "invalid",
    "listed",
    "no_nul",
    "node_range",
    "number_to_str",
    "shown",
    "split_nodes",
    "stripped_hint",
]

ERROR_TYPE = "ddpkit"
# Upper bounds: far above any real cluster, so a larger value is a typo, refused before anything
# is sized from it (``plan`` builds a row per rank).
MAX_NODES = 100_000
MAX_PER_NODE = 1024  # processes or GPUs on one node
MAX_CPUS = 65_535  # SLURM's cpus-per-task is a 16-bit number
MAX_MEM_GB = 2**20  # a pebibyte per node
MAX_TIME_MIN = 5_256_000  # ten years
MAX_REQUEUES = 1_000_000
LIMIT_HINTS = {
    "nodes": "the largest SLURM clusters have some tens of thousands of nodes: a typo?",
    "gpus_per_node": "a node has a handful of GPUs: a typo?",
    "procs_per_node": "one process per GPU or a few per node: a typo?",
    "cpus_per_task": f"SLURM counts CPUs per task up to {MAX_CPUS}: a typo?",
    "cpus_per_node": f"SLURM counts CPUs up to {MAX_CPUS}: a typo?",
    "mem_gb": "mem_gb is in gigabytes per node: a typo?",
    "time_min": "time_min is in minutes; ask for what the partition allows (sinfo -o '%P %l')",
}
_NODE_RANGE = re.compile(r"([0-9]+)-([0-9]+)")
SHOWN_CHARS = 200  # how much of a bad value an error message quotes
_SHOWN_DEPTH = 4


class Model(BaseModel):
    # strict: YAML already has types; no 'yes' -> 1 or '2' -> 2 guessing behind the user's back
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def invalid(
    problem: str, hint: str, *, field: str | None = None, value: object = ...
) -> PydanticCustomError:
    """A validation error ``ddpkit.jobs.load`` turns into ``<field>=<value>: <problem> (hint)``.

    ``field``/``value`` are for checks spanning fields (pydantic has no location for those).
    """
    ctx: dict[str, object] = {"problem": problem, "hint": hint}
    if field is not None:
        ctx["field"] = field
    if value is not ...:
        ctx["value"] = value
    return PydanticCustomError(ERROR_TYPE, "{problem}", ctx)


def node_range(text: str) -> tuple[int, int]:
    """``nodes: MIN-MAX`` as (MIN, MAX), or the one-line reason it is not a range."""
    found = _NODE_RANGE.fullmatch(text)
    if found is None:
        example = "e.g. nodes: 2, or nodes: 1-2 for 2 nodes or 1 when only 1 is left"
        raise invalid(
            "is not a whole number or a range MIN-MAX",
            f"write it unquoted: nodes: {text}" if text.isdigit() else example,
            field="nodes",
            value=text,
        )
    low, high = int(found[1]), int(found[2])
    if low < 1:
        raise invalid(
            "starts at 0: a job needs a node",
            f"MIN >= 1, e.g. nodes: 1-{max(high, 2)}",
            field="nodes",
            value=text,
        )
    if low > high:
        raise invalid(
            f"has MIN {low} above MAX {high}",
            f"MIN <= MAX, e.g. nodes: {high}-{low}",
            field="nodes",
            value=text,
        )
    if high > MAX_NODES:
        raise invalid(
            f"has MAX {high}, more than {MAX_NODES}, ddpkit's limit",
            LIMIT_HINTS["nodes"],
            field="nodes",
            value=text,
        )
    return low, high


def split_nodes(data: object) -> object:
    """A spec's input with ``nodes: MIN-MAX`` (a string: YAML and ``--set nodes=1-2`` read it
    so) as ``nodes=MAX, min_nodes=MIN``; ``MIN-MIN`` is a fixed count. ``min_nodes`` is not a
    key the input may have."""
    if not isinstance(data, dict):
        return data
    if "min_nodes" in data:
        raise invalid(
            "is not a key of its own",
            "write the range as nodes: MIN-MAX, e.g. nodes: 1-2",
            field="min_nodes",
            value=data["min_nodes"],
        )
    nodes = data.get("nodes")
    if not isinstance(nodes, str):
        return data
    low, high = node_range(nodes)
    return {**data, "nodes": high, "min_nodes": low if low < high else None}


def no_nul(text: str) -> str:
    if "\x00" in text:
        raise invalid("contains a NUL character", "remove it: no shell or file name can hold it")
    return text


def listed(value: object) -> object:
    """One string where a list of them is meant (``setup: 'module load x'``) as that list."""
    return [value] if isinstance(value, str) else value


def number_to_str(value: object) -> object:
    """YAML reads ``4`` and ``0.1`` as numbers; where a string is meant, take their text."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def stripped_hint(key: str, pattern: re.Pattern[str]) -> str | None:
    """The hint for a key that is valid but for surrounding whitespace (a YAML block scalar or
    a copied line can carry a newline or a CR), else None."""
    if key != key.strip() and pattern.fullmatch(key.strip()):
        return f"write {shown(key.strip())}, without the surrounding whitespace or line break"
    return None


def shown(value: object, limit: int = SHOWN_CHARS, *, quote: bool = True) -> str:
    """``value`` as an error message quotes it: its ``repr`` (the text itself with
    ``quote=False``), cut after about ``limit`` characters with ``...``.

    The cost is bounded by ``limit`` too: a YAML alias bomb's value is a few hundred bytes of
    input whose full ``repr`` is tens of megabytes, and a 100 kB ``--set`` value is no better
    for being printed whole. Small lists, dicts and scalars come out exactly as ``repr``.
    """
    if not quote and isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "..."
    return _short_repr(value, limit, set())


def _short_repr(value: object, budget: int, path: set[int]) -> str:
    if isinstance(value, str):
        return repr(value) if len(value) <= budget else repr(value[:budget]) + "..."
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 640:
        return f"<a number of about {int(value.bit_length() * 0.30103)} digits>"
    if not isinstance(value, list | tuple | dict | set | frozenset):
        text = repr(value)
        return text if len(text) <= budget else text[:budget] + "..."
    brackets = "{}" if isinstance(value, dict | set | frozenset) else "[]"
    brackets = "()" if isinstance(value, tuple) else brackets
    if id(value) in path or len(path) >= _SHOWN_DEPTH:
        return f"{brackets[0]}...{brackets[1]}"
    path.add(id(value))
    parts: list[str] = []
    used = 0
    items = value.items() if isinstance(value, dict) else value
    for item in items:
        if used >= budget:
            parts.append("...")
            break
        if isinstance(value, dict):
            key, val = item
            left = budget - used
            text = f"{_short_repr(key, left, path)}: {_short_repr(val, left, path)}"
        else:
            text = _short_repr(item, budget - used, path)
        parts.append(text)
        used += len(text) + 2
    path.discard(id(value))
    inner = ", ".join(parts) + ("," if isinstance(value, tuple) and len(value) == 1 else "")
    return brackets[0] + inner + brackets[1]
