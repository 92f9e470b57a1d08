"""Rank 0's judgment of the heartbeat counters: which ranks' counters stood still for the bound.

Pure (no store, no threads): the store link reads every counter once an interval and hands
them here. It runs on the training process's GIL, so in C's loops rather than Python's: which
counters moved (most did not: the others beat once a beat interval), then the oldest move,
and only when that is as old as the bound a look for the ranks it names. A Python loop over
every rank took 22 ms a round at 98,304 ranks; this ~4 ms.
"""

from __future__ import annotations

import math
import operator
from itertools import compress


class BeatJudge:
    """Each counter as last read and when it last moved; ``own`` (rank 0) is never judged."""

    def __init__(self, own: int, bound_s: float) -> None:
        self._own, self._bound_s = own, bound_s
        self._seen: list[bytes] | None = None
        self._moved: list[float] = []

    def still(self, values: list[bytes], now: float) -> list[tuple[int, float]]:
        """The ranks whose counter has not moved for the bound, with how long, each once: a
        rank judged gone stays so (a counter that moves again does not bring it back)."""
        if self._seen is None:  # the first round: every counter counts from now
            self._seen, self._moved = list(values), [now] * len(values)
            self._moved[self._own] = math.inf
            return []
        seen, moved = self._seen, self._moved
        for rank in compress(range(len(values)), map(operator.ne, values, seen)):
            seen[rank] = values[rank]
            if moved[rank] != math.inf:
                moved[rank] = now
        if now - min(moved) < self._bound_s:
            return []
        found = [(rank, now - since) for rank, since in enumerate(moved)
                 if now - since >= self._bound_s]  # fmt: skip
        for rank, _ in found:
            moved[rank] = math.inf
        return found
