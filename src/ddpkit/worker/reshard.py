"""Where an epoch goes on when a run resumes at another world size or batch size.

The layout is ``DistributedSampler``'s: an epoch's *order* is a permutation of ``range(N)``
(``torch.randperm`` seeded ``seed + epoch``; ``range(N)`` without shuffle), padded to
``ceil(N / W) * W`` positions by repeating its head (or cut to ``floor(N / W) * W`` with
``drop_last``), and rank ``r`` takes positions ``r, r + W, ...``. The ranks step in lockstep
through batches of ``B`` rows, so after ``b`` batches they consumed a *prefix* of the order,
positions ``[0, b * B * W)``.

A pass that starts at ``start`` lays out the rest, ``order[start:]``, the same way (a fresh
epoch is ``start == 0``, exactly torch's layout), and again consumes a prefix of it, so an
epoch's progress is one number whatever world and batch sizes its pieces ran at: the real
positions consumed, ``min(N, start + b * B * W)``. A resume at the same world and batch size
skips the saved batches of the same pass (bitwise the uninterrupted run); any other starts a
pass at that number, so every sample of the epoch is still read exactly once (with
``drop_last``: at most once).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ddpkit.errors import ConfigError

__all__ = ["PassStart", "epoch_order", "per_rank", "remap", "shard"]


@dataclass(frozen=True)
class PassStart:
    """Where the next pass begins: its epoch, the positions of the epoch's order consumed
    before the pass (``start``), and the batches of the pass itself to leave out (``skip``)."""

    epoch: int
    start: int
    skip: int


def per_rank(dataset_len: int, start: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank gets from a pass over ``order[start:]`` (torch's ``num_samples`` at
    ``start == 0``)."""
    rest = max(0, dataset_len - start)
    return rest // world_size if drop_last else math.ceil(rest / world_size)


def epoch_order(dataset_len: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The epoch's global order, as ``DistributedSampler.__iter__`` draws it."""
    if not shuffle:
        return list(range(dataset_len))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order: list[int] = torch.randperm(dataset_len, generator=generator).tolist()
    return order


def shard(order: list[int], start: int, world_size: int, rank: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s indices of a pass over ``order[start:]``, in the order it reads them."""
    rest = order[start:]
    count = per_rank(len(order), start, world_size, drop_last)
    total = count * world_size
    if total > len(rest):  # pad by repeating the head of the rest, as torch pads the order
        padding = total - len(rest)
        rest = rest + (rest * math.ceil(padding / len(rest)))[:padding]
    return rest[rank:total:world_size]


def remap(
    saved: Mapping[str, Any], *, world_size: int, batch_size: int, dataset_len: int
) -> PassStart:
    """The start of the next pass for a loader of ``world_size`` and ``batch_size`` that
    resumes from ``saved`` (a ``DistributedLoader.state_dict()``; ``start`` absent in states
    written before it existed means 0)."""
    epoch = saved["epoch"]
    batches = _count(saved, "batches", maximum=None)
    start = _count(saved, "start", maximum=dataset_len, default=0)
    old_world = _count(saved, "world_size", maximum=None, default=world_size, minimum=1)
    old_batch = _count(saved, "batch_size", maximum=None, default=batch_size, minimum=1)
    if (old_world, old_batch) == (world_size, batch_size):
        return PassStart(epoch, start, batches)
    return PassStart(epoch, min(dataset_len, start + batches * old_batch * old_world), 0)


def _count(
    saved: Mapping[str, Any],
    key: str,
    *,
    maximum: int | None,
    default: int | None = None,
    minimum: int = 0,
) -> int:
    value = saved.get(key, default)
    fits = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if fits and (maximum is None or value <= maximum):
        return int(value)
    limit = f" and <= {maximum}" if maximum is not None else ""
    raise ConfigError(
        f"loader state {key}={value!r} must be an int >= {minimum}{limit}",
        hint="pass a dict that DistributedLoader.state_dict() returned",
    )
