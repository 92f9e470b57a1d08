"""The straggler report: which rank the others keep waiting for, and on what.

In a DDP job every rank waits for the slowest at each gradient all-reduce, so a slow rank costs
every GPU its delay and shows up nowhere: the step is slow everywhere. Each rank keeps its own
times (:mod:`ddpkit.worker.steptimes`: the time inside ``ddpkit.loader``'s fetches, and DDP's
sampled forward + backward compute) and posts their running totals to the store every period
(``DDPKIT_STRAGGLER_INTERVAL``, default 300 s; ``0`` or ``off`` turns it off); rank 0 reads them
all at once (one ``check``, one ``multi_get``) and compares, per step over the period, each
rank's own work (data wait + compute) with the fastest rank's. When the same rank is the slowest
by more than a quarter of the step (and 2 ms) for two periods in a row, rank 0 prints::

    ddpkit: straggler: rank 1 (host n2) was the slowest for 2 periods of 300 s: per step, data
    21.0 ms + compute 3.2 ms, against 0.1 + 3.1 ms on the fastest rank (rank 0); the job's step
    is 25.0 ms, so every rank waits about 21.0 ms a step for it; likely cause: its data loading

and again each period while it lasts. An even run (every gap under the threshold, or the
slowest rank changing from one period to the next) prints nothing. What it cannot see: work
outside the loader and the model (a rank's own Python between steps) counts for neither.
Only store operations, on the watchdog's thread, never a collective.
"""

from __future__ import annotations

import json
import socket
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ddpkit.cluster.durations import seconds_from_env
from ddpkit.cluster.envvars import to_float
from ddpkit.contract import DEFAULT_STRAGGLER_INTERVAL_S, STRAGGLER_INTERVAL_VAR
from ddpkit.worker.rendezvous import batched

RELATIVE = 0.25  # the slowest rank's extra own work, as a share of the step, to count
FLOOR_S = 0.002  # ... and at least this much a step
PERIODS = 2  # periods in a row with the same slowest rank before the report
MIN_STEPS = 5  # a rank with fewer steps in a period is not compared in it
CALL_S = 5.0  # kept for the link's call (each store operation is bounded by the link)


def straggler_interval(env: Mapping[str, str]) -> float | None:
    """The report's period in seconds, or None when off (``0``/``off``)."""
    raw = env.get(STRAGGLER_INTERVAL_VAR, "").strip().lower()
    if raw == "off" or to_float(raw) == 0:
        return None
    value = seconds_from_env(
        env,
        STRAGGLER_INTERVAL_VAR,
        example="300",
        hint=f"e.g. {STRAGGLER_INTERVAL_VAR}=300 (seconds), or {STRAGGLER_INTERVAL_VAR}=off",
    )
    return DEFAULT_STRAGGLER_INTERVAL_S if value is None else value


@dataclass(frozen=True)
class PerStep:
    """One rank's period, per step: its data wait, its compute (None: unknown), its step."""

    host: str
    data_s: float
    compute_s: float | None
    step_s: float


@dataclass(frozen=True)
class Finding:
    rank: int
    fastest: int
    gap_s: float
    cause: str


def per_step(before: Mapping[str, Any], after: Mapping[str, Any]) -> PerStep | None:
    """A rank's period from two of its posted totals; None with too few steps in it."""
    steps = int(after["steps"]) - int(before["steps"])
    if steps < MIN_STEPS:
        return None
    compute = after.get("compute_s")
    return PerStep(
        host=str(after.get("host", "?")),
        data_s=(float(after["data_s"]) - float(before["data_s"])) / steps,
        compute_s=None if compute is None else float(compute),
        step_s=(float(after["step_s"]) - float(before["step_s"])) / steps,
    )


def slowest(period: Mapping[int, PerStep]) -> Finding | None:
    """The rank whose own work exceeds the fastest rank's by the threshold, if any."""
    if len(period) < 2:
        return None
    known = all(entry.compute_s is not None for entry in period.values())
    own = {rank: e.data_s + ((e.compute_s or 0.0) if known else 0.0) for rank, e in period.items()}
    fastest = min(own, key=lambda rank: own[rank])
    worst = max(own, key=lambda rank: own[rank])
    gap = own[worst] - own[fastest]
    step = statistics.median(entry.step_s for entry in period.values())
    if gap < max(RELATIVE * step, FLOOR_S):
        return None
    data_gap = period[worst].data_s - min(entry.data_s for entry in period.values())
    cause = "its data loading (time inside ddpkit.loader's fetches)"
    if data_gap < gap / 2:
        cause = "its compute (forward and backward, as DDP measures them)"
    return Finding(worst, fastest, gap, cause)


def report(finding: Finding, period: Mapping[int, PerStep], periods: int, period_s: float) -> str:
    slow, fast = period[finding.rank], period[finding.fastest]
    step = statistics.median(entry.step_s for entry in period.values())

    def ms(value: float | None) -> str:
        return "?" if value is None else f"{value * 1000:.1f}"

    return (
        f"ddpkit: straggler: rank {finding.rank} (host {slow.host}) was the slowest for "
        f"{periods} periods of {period_s:g} s: per step, data {ms(slow.data_s)} ms + compute "
        f"{ms(slow.compute_s)} ms, against {ms(fast.data_s)} + {ms(fast.compute_s)} ms on the "
        f"fastest rank (rank {finding.fastest}); the job's step is {ms(step)} ms, so every rank "
        f"waits about {ms(finding.gap_s)} ms a step for it; likely cause: {finding.cause}"
    )


class Judge:
    """Rank 0's memory across periods: the previous totals and who was slowest in a row."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._previous: dict[int, Mapping[str, Any]] = {}
        self._rank: int | None = None
        self._row = 0

    def feed(self, totals: Mapping[int, Mapping[str, Any]]) -> str | None:
        period = {}
        for rank, now in totals.items():
            before = self._previous.get(rank)
            entry = per_step(before, now) if before is not None else None
            if entry is not None:
                period[rank] = entry
        self._previous = dict(totals)
        finding = slowest(period)
        if finding is None:
            self._rank, self._row = None, 0
            return None
        self._row = self._row + 1 if finding.rank == self._rank else 1
        self._rank = finding.rank
        return report(finding, period, self._row, self.period_s) if self._row >= PERIODS else None


class StragglerWatch:
    """Posts this rank's totals every period and, on rank 0, judges them (watchdog thread)."""

    def __init__(
        self,
        call: Callable[[Callable[[], None], float], bool],
        store: Callable[[], Any],
        *,
        rank: int,
        world_size: int,
        period_s: float,
        totals: Callable[[], Mapping[str, Any]],
        clock: Callable[[], float],
    ) -> None:
        # the link's call runs work on the watchdog's thread, over the link's store
        self._call, self._store = call, store
        self.rank, self.world_size, self.period_s = rank, world_size, period_s
        self._totals, self._clock = totals, clock
        self._next = clock() + period_s
        self._host = socket.gethostname()
        self.judge = Judge(period_s) if rank == 0 else None

    def check(self, now: float) -> str | None:
        """Every period: post, and on rank 0 read and judge; the report line or None."""
        if now < self._next:
            return None
        self._next = now + self.period_s
        mine = json.dumps({**self._totals(), "host": self._host})
        self._call(lambda: self._store().set(f"straggler/{self.rank}", mine), CALL_S)
        if self.judge is None:
            return None
        keys = [f"straggler/{rank}" for rank in range(self.world_size)]
        read: list[Any] = []

        def gather() -> None:
            store = self._store()
            if batched.check(store, keys):  # every rank posted once: multi_get will not block
                read.extend(batched.multi_get(store, keys))

        if not self._call(gather, CALL_S) or not read:
            return None
        totals = {rank: json.loads(bytes(value)) for rank, value in enumerate(read)}
        return self.judge.feed(totals)
