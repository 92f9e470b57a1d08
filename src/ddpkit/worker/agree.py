"""Sharing a failure between ranks, so that every rank raises instead of one waiting for ever.

    world()           (world size, rank) of the process group that exists, ddpkit's or torch's
    describe(error)   a failure as it travels: ddpkit's errors by message and hint, others by
                      their type and text
    all_gather, broadcast    the object collectives, without a group at world size 1
    raise_failures    raise :class:`~ddpkit.errors.CheckpointError` on every rank when any
                      failed, the ranks that failed alike named together

Used by the checkpoints (:mod:`ddpkit.worker.checkpoint`, :mod:`ddpkit.worker.sharded`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ddpkit.errors import CheckpointError, DdpkitError
from ddpkit.worker.context import current_or_none

__all__ = ["all_gather", "broadcast", "describe", "raise_failures", "world"]

# what a failure becomes to share it between ranks: its text and its own hint, or None
_Failure = tuple[str, str | None] | None


def world() -> tuple[int, int]:
    """(world size, rank) of the process group that exists, ddpkit's or plain torch's."""
    context = current_or_none()
    if context is None:
        return 1, 0
    return context.world_size, context.rank


def describe(error: BaseException | None) -> _Failure:
    """A failure as it travels to the other ranks: ddpkit's own errors by their message and
    hint, any other by its type and text."""
    if error is None:
        return None
    if isinstance(error, DdpkitError):
        return error.message, error.hint
    return f"{type(error).__name__}: {error}", None


def all_gather(world_size: int, mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (a collective when the world is larger than one)."""
    if world_size == 1:
        return [mine]
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    return every


def broadcast(world_size: int, value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def raise_failures(
    failures: list[_Failure], what: str, *, hint: str, own: Exception | None
) -> None:
    """Raise on every rank when any rank failed (its own error chained); ranks that failed
    alike are named together, and the first failure's own hint, if any, replaces ``hint``."""
    failed = [(number, failure) for number, failure in enumerate(failures) if failure]
    if not failed:
        return
    by_text: dict[str, list[int]] = {}
    for number, (text, _) in failed:
        by_text.setdefault(text, []).append(number)
    causes = "; ".join(f"{ranks_named(numbers)}: {text}" for text, numbers in by_text.items())
    own_hint = next((given for _, (_, given) in failed if given), None)
    ranks = ranks_named([number for number, _ in failed])
    raise CheckpointError(f"{ranks} {what}: {causes}", hint=own_hint or hint) from own


def ranks_named(numbers: list[int]) -> str:
    label = "rank" if len(numbers) == 1 else "ranks"
    return f"{label} {', '.join(str(number) for number in numbers)}"
