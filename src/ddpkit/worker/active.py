"""Which ``ddpkit.loader`` pass yielded the latest batch, for ``ddpkit.gather``.

Each batch a loader's iterator yields marks that iterator as the active one
(:class:`ActiveSlot`, held by :mod:`ddpkit.worker.loader`), through weak references, so a
finished or abandoned loop (and its loader and dataset) is never kept alive, and in a stack, so
when an inner loop (evaluation inside training) ends or is left with ``break``, the outer
loop's step is the active one again. Each pass carries a :class:`GatherMemo` of what ``gather``
agreed with the other ranks during it. Knows nothing of the loader (which imports this module).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

__all__ = ["ActiveSlot", "GatherMemo"]

P = TypeVar("P")


@dataclass
class GatherMemo:
    """What ``ddpkit.gather`` has agreed with the other ranks during one pass: the same on
    every rank, because every rank makes the same calls in the same order (SPMD).

    ``calls`` counts the gathers of step ``step``; ``agreed[i]`` is the (dtype, trailing
    shape) that the i-th gather of a step had on every rank when last checked.
    """

    step: int = -1
    calls: int = 0
    agreed: dict[int, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)

    def ordinal(self, step: int) -> int:
        """The index of this gather among the calls of ``step`` (counting it)."""
        if step != self.step:
            self.step, self.calls = step, 0
        self.calls += 1
        return self.calls - 1


class ActiveSlot(Generic[P]):
    """Weak references to the live passes, the one that yielded the latest batch on top."""

    def __init__(self) -> None:
        self._stack: list[weakref.ref[P]] = []

    def _prune(self, drop: P | None = None) -> None:
        self._stack = [ref for ref in self._stack if ref() is not None and ref() is not drop]

    def mark(self, iterator: P) -> None:
        if self._stack and self._stack[-1]() is iterator:  # every batch of a loop: no change
            return
        self._prune(drop=iterator)
        self._stack.append(weakref.ref(iterator))

    def finish(self, iterator: P) -> None:
        self._prune(drop=iterator)

    def get(self) -> P | None:
        top = self._stack[-1]() if self._stack else None
        if top is None:  # the latest pass was collected: fall back to a live one
            self._prune()
            top = self._stack[-1]() if self._stack else None
        return top
