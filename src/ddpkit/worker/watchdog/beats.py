"""Rank 0's judgment of the heartbeat counters: which ranks' counters stood still for the bound,
and which for a shorter gap (:meth:`BeatJudge.stale`: what it publishes for a failed
collective's survivors, read by :class:`StaleWatch`).

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

    def __init__(self, own: int, bound_s: float, world_size: int, parts: int = 1) -> None:
        self._own, self._bound_s, self._world = own, bound_s, world_size
        self._size, self._parts, self._rounds = -(-world_size // parts), parts, 0
        self._seen: list[bytes] | None = None
        self._moved: list[float] = []
        self._oldest = math.inf  # the oldest move as of the last round

    def still(self, values: list[bytes], now: float, start: int = 0) -> list[tuple[int, float]]:
        """The ranks whose counter has not moved for the bound, with how long, each once: a
        rank judged gone stays so (a counter that moves again does not bring it back).
        ``values`` are the counters of ranks ``start`` on (rank 0 reads them a part a round;
        every one at the first round)."""
        if self._seen is None:  # the first round: every counter counts from now
            self._seen, self._moved = list(values), [now] * len(values)
            self._moved[self._own] = math.inf
            return []
        seen, moved = self._seen, self._moved
        before = seen[start : start + len(values)]
        for index in compress(range(len(values)), map(operator.ne, values, before)):
            rank = start + index
            seen[rank] = values[index]
            if moved[rank] != math.inf:
                moved[rank] = now
        self._oldest = min(moved)
        if now - self._oldest < self._bound_s:
            return []
        found = [(rank, now - since) for rank, since in enumerate(moved)
                 if now - since >= self._bound_s]  # fmt: skip
        for rank, _ in found:
            moved[rank] = math.inf
        return found

    def next_part(self) -> tuple[int, int]:
        """The ranks whose counters the next round reads (``start``, ``end``): every one at
        the first, then a part a round, in turn (policy.judging_parts)."""
        self._rounds += 1
        if self._seen is None or self._parts == 1:
            return 0, self._world
        start = self._size * ((self._rounds - 2) % self._parts)
        return start, min(self._world, start + self._size)

    def stale(self, now: float, gap_s: float) -> list[int]:
        """The ranks whose counter has not moved for ``gap_s`` (shorter than the bound) as of
        the last round, not yet judged gone; a look at every rank only when one can be."""
        if now - self._oldest < gap_s:
            return []
        since = now - gap_s
        return list(compress(range(len(self._moved)), map(since.__ge__, self._moved)))


def encode_stale(ranks: list[int]) -> str:
    """What rank 0 publishes: the stale ranks, comma-separated."""
    return ",".join(map(str, ranks))


class StaleWatch:
    """A survivor's reading of what rank 0 publishes while a failed collective hurries it.

    Each read is rank 0's round counter (its own beat key, bumped at the start of each round)
    and its list of stale ranks (published within a round, when it changes). A rank listed
    is silent; rank 0 itself is, when its counter stood still for the gap (its judging
    stopped with it: the job's store outlives it under torchrun's agent). Until then: None.
    """

    def __init__(self, own: int, world_size: int, gap_s: float) -> None:
        self._own, self._world, self._gap_s = own, world_size, gap_s
        self._round: bytes | None = None
        self._since = 0.0  # when the round counter was last seen to move

    def read(self, now: float, round_: bytes, published: bytes) -> list[int] | None:
        if round_ != self._round:
            self._round, self._since = round_, now
        found = [rank for rank in _ranks(published, self._world) if rank != self._own]
        if found:
            return found
        if now - self._since >= self._gap_s and self._own != 0:
            return [0]
        return None


def _ranks(published: bytes, world_size: int) -> list[int]:
    """The ranks a published list names; anything else in it (the store is not ddpkit's
    alone: whoever reaches its port can write) is ignored."""
    found = []
    for item in published.decode(errors="replace").split(","):
        item = item.strip()
        if item.isascii() and item.isdigit() and int(item) < world_size:
            found.append(int(item))
    return found
