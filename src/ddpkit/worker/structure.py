"""Splitting a batch of any structure into per-device slices, and putting results back together.

Pure functions over nested values, used by :mod:`ddpkit.worker.dataparallel`. Structures are
tensors, tuples, lists, dicts, namedtuples and dataclasses, nested to any depth; any other value
is a leaf passed to every slice as it is. torch's ``scatter`` passes a dataclass whole and its
``gather`` fails on one; here a dataclass is rebuilt field by field (``copy.copy``, then each
field set: frozen ones work too).

A tensor is split when its leading size is the batch's; a 0-dim tensor goes to every slice
whole; another leading size is an error naming where it is, not a silent mis-split.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ddpkit.errors import ConfigError

__all__ = ["batch_rows", "combine", "concat", "map_tensors", "split", "split_sizes"]

REDUCTIONS: tuple[str, ...] = ("mean", "sum")


def split_sizes(total: int, parts: int, *, first: int | None = None) -> list[int]:
    """Samples per device (trailing zeros when the batch is small): torch's ``chunk`` rule, 10
    on 4 devices are 3/3/3/1; ``first``: at most that many on the first (output) device, the
    rest split evenly over the others (BalancedDataParallel's ``gpu0_bsz``)."""
    if parts < 1:
        raise ConfigError(f"devices={parts} must be at least 1", hint="pass one device or more")
    if first is not None and (isinstance(first, bool) or not isinstance(first, int) or first < 1):
        raise ConfigError(
            f"first_device_batch={first!r} must be an int >= 1",
            hint="the number of samples the first (output) device takes; None splits evenly",
        )
    if first is None or parts == 1:
        return _even(total, parts)
    head = min(first, math.ceil(total / parts))
    return [head, *_even(total - head, parts - 1)]


def _even(total: int, parts: int) -> list[int]:
    chunk = max(1, math.ceil(total / parts))
    return [max(0, min(chunk, total - index * chunk)) for index in range(parts)]


def batch_rows(value: Any) -> int | None:
    """The leading size of the first tensor with at least one dimension, or None."""
    rows: list[int] = []

    def note(tensor: torch.Tensor) -> None:
        if tensor.dim() > 0:
            rows.append(int(tensor.shape[0]))

    map_tensors(value, note)
    return rows[0] if rows else None


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, the structure rebuilt."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    children = _children(value)
    if children is None:
        return value
    return _rebuild(value, {key: map_tensors(child, fn) for key, child in children.items()})


def split(value: Any, sizes: Sequence[int], *, rows: int, where: str = "batch") -> list[Any]:
    """One structure per size in ``sizes`` (which add up to ``rows``), in order."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return [value] * len(sizes)
        if value.shape[0] != rows:
            raise ConfigError(
                f"{where} is a tensor of {value.shape[0]} rows in a batch of {rows}",
                hint="every tensor of a batch is split along dim 0; pass other tensors as "
                "model attributes (or buffers) instead of as inputs",
            )
        return list(torch.split(value, list(sizes)))
    children = _children(value)
    if children is None:
        return [value] * len(sizes)
    parts = {
        key: split(child, sizes, rows=rows, where=f"{where}[{key!r}]")
        for key, child in children.items()
    }
    return [
        _rebuild(value, {key: part[index] for key, part in parts.items()})
        for index in range(len(sizes))
    ]


def concat(parts: Sequence[Any], *, where: str = "output") -> Any:
    """The slices' outputs as one structure: tensors joined along dim 0 (0-dim ones stacked,
    as torch's ``gather`` does), equal leaves kept once, differing ones listed."""
    head = parts[0]
    if isinstance(head, torch.Tensor):
        _same_kind(parts, torch.Tensor, where)
        return torch.stack(list(parts)) if head.dim() == 0 else torch.cat(list(parts))
    return _merge_children(parts, where, lambda same, at: concat(same, where=at))


def combine(
    results: Sequence[Any], sizes: Sequence[int], *, reduction: str, where: str = "loss"
) -> Any:
    """Per-slice losses and metrics as one: every scalar (0-dim tensor or number) is the mean
    weighted by slice size, ``sum(n_i * l_i) / N`` (``reduction="mean"``) or the plain sum
    (``"sum"``; :func:`ddpkit.balanced_loss` checks it); tensors with rows are joined in order."""
    head = results[0]
    total = sum(sizes)
    if isinstance(head, torch.Tensor) and head.dim() == 0:
        _same_kind(results, torch.Tensor, where)
        if reduction == "sum":
            return torch.stack(list(results)).sum()
        weights = torch.tensor(sizes, dtype=head.dtype, device=head.device) / total
        return (torch.stack(list(results)) * weights).sum()
    if isinstance(head, torch.Tensor):
        return torch.cat(list(results))
    if isinstance(head, int | float) and not isinstance(head, bool):
        if reduction == "sum":
            return sum(results)
        return sum(size * value for size, value in zip(sizes, results, strict=True)) / total
    return _merge_children(
        results, where, lambda same, at: combine(same, sizes, reduction=reduction, where=at)
    )


def _merge_children(
    parts: Sequence[Any], where: str, merge: Callable[[list[Any], str], Any]
) -> Any:
    """The slices' structures as one, ``merge`` joining each key's values: leaves that are not
    structures are kept once when equal, listed when they differ."""
    head = parts[0]
    children = _children(head)
    if children is None:
        return head if all(_equal(part, head) for part in parts) else list(parts)
    _same_kind(parts, type(head), where)
    every = [_children(part) for part in parts]
    return _rebuild(
        head,
        {
            key: merge([kids[key] for kids in every if kids is not None], f"{where}[{key!r}]")
            for key in children
        },
    )


def _children(value: Any) -> dict[Any, Any] | None:
    """The parts of a structure by key (index, dict key or field name); None for a leaf."""
    if isinstance(value, tuple | list):
        return dict(enumerate(value))
    if isinstance(value, Mapping):
        return dict(value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    return None


def _rebuild(template: Any, parts: dict[Any, Any]) -> Any:
    """A value like ``template`` holding ``parts`` (keys as :func:`_children` gives them)."""
    if isinstance(template, tuple) and hasattr(template, "_fields"):  # a namedtuple
        return type(template)(*parts.values())
    if isinstance(template, tuple | list):
        values = list(parts.values())
        return values if type(template) is list else type(template)(values)
    if isinstance(template, Mapping):
        # A copy keeps the mapping's type and extras (OrderedDict, defaultdict's factory).
        rebuilt = copy.copy(template)
        for key, part in parts.items():
            rebuilt[key] = part  # type: ignore[index]
        return rebuilt
    rebuilt = copy.copy(template)
    for name, part in parts.items():
        object.__setattr__(rebuilt, name, part)  # frozen dataclasses too
    return rebuilt


def _same_kind(values: Sequence[Any], kind: type, where: str) -> None:
    for value in values:
        if not isinstance(value, kind):
            raise TypeError(
                f"{where}: one slice gave {type(value).__name__}, another {kind.__name__}; "
                "every slice must return the same structure"
            )


def _equal(left: Any, right: Any) -> bool:
    try:
        return bool(left is right or left == right)
    except Exception:  # values whose == is not a bool (arrays)
        return False
