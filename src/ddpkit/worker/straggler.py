"""The straggler report: which rank the others keep waiting for, and on what.

In a DDP job every rank waits for the slowest at each gradient all-reduce, so a slow rank shows
up nowhere: the step is slow everywhere. Each rank keeps its own step times (:data:`TIMES`: the
loader's fetches, DDP's sampled compute); every period (``DDPKIT_STRAGGLER_INTERVAL``) each rank
posts them to the store and rank 0 names a rank that stays the slowest (:class:`Judge`). It runs
on the watchdog's thread and bounded store link: store operations only, never a collective.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddpkit.cluster.durations import seconds_or_off
from ddpkit.contract import DEFAULT_STRAGGLER_INTERVAL_S, STRAGGLER_INTERVAL_VAR
from ddpkit.worker.watchdog.store import StoreLink
from ddpkit.worker.watchdog.watcher import Watchdog, write_stderr

RELATIVE = 0.25  # the slowest rank's extra own work, as a share of the step, to count
FLOOR_S = 0.002  # ... and at least this much a step
PERIODS = 2  # periods in a row with the same slowest rank before the report
MIN_STEPS = 5  # a rank with fewer steps in a period is not compared in it
COMPUTE_EVERY = 100  # batches between reads of DDP's compute figures


class StepTimes:
    """This rank's running totals, written by the training thread (the loader's iterator, where
    DDP writes its figures too) and read by the watchdog's, under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0  # batches fetched
        self.data_s = 0.0  # time inside the fetches
        self.step_s = 0.0  # time from one fetch's end to the next one's end
        self.compute_s: float | None = None  # DDP's forward + backward compute per step
        self._last_end: float | None = None
        self._model: weakref.ReferenceType[Any] | None = None

    def batch(self, started: float, ended: float) -> None:
        """One batch fetched between ``started`` and ``ended`` (``time.perf_counter``)."""
        with self._lock:
            self.steps += 1
            self.data_s += ended - started
            if self._last_end is not None:
                self.step_s += ended - self._last_end
            self._last_end = ended
        if self.steps % COMPUTE_EVERY == 0:
            self._read_compute()

    def pass_ended(self) -> None:
        """The pass ended: the time until the next pass's first batch is not a step."""
        with self._lock:
            self._last_end = None

    def watch_model(self, model: Any) -> None:
        self._model = weakref.ref(model)

    def totals(self) -> dict[str, Any]:
        with self._lock:
            return {"steps": self.steps, "data_s": self.data_s, "step_s": self.step_s,
                    "compute_s": self.compute_s}  # fmt: skip

    def _read_compute(self) -> None:
        model = self._model() if self._model is not None else None
        if model is not None:
            from ddpkit.compat import ddp_compute_s

            value = ddp_compute_s(model)
            with self._lock:
                self.compute_s = value


TIMES = StepTimes()


def straggler_interval(env: Mapping[str, str]) -> float | None:
    """The report's period in seconds, or None when off (``0``/``off``)."""
    return seconds_or_off(
        env, None, STRAGGLER_INTERVAL_VAR, "", DEFAULT_STRAGGLER_INTERVAL_S, example="300"
    )


@dataclass(frozen=True)
class PerStep:
    """One rank's period, per step: its data wait, its compute (None: unknown), its step."""

    host: str
    data_s: float
    compute_s: float | None
    step_s: float


def slowest(period: Mapping[int, PerStep]) -> tuple[int, int, float, str] | None:
    """(the slowest rank, the fastest, the gap a step, the likely cause) when the slowest
    rank's own work (data wait, and compute when every rank knows it: DDP samples late on some
    ranks) exceeds the fastest rank's by the threshold; else None."""
    if len(period) < 2:
        return None
    known = all(entry.compute_s is not None for entry in period.values())
    own = {rank: e.data_s + ((e.compute_s or 0.0) if known else 0.0) for rank, e in period.items()}
    fastest, worst = min(own, key=own.__getitem__), max(own, key=own.__getitem__)
    gap = own[worst] - own[fastest]
    if gap < max(RELATIVE * statistics.median(e.step_s for e in period.values()), FLOOR_S):
        return None
    data_gap = period[worst].data_s - min(entry.data_s for entry in period.values())
    if data_gap < gap / 2:
        return worst, fastest, gap, "its compute (forward and backward, as DDP measures them)"
    return worst, fastest, gap, "its data loading (time inside ddpkit.loader's fetches)"


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value * 1000:.1f}"


class Judge:
    """Rank 0's memory across periods: the previous totals and who was slowest in a row."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._previous: dict[int, Mapping[str, Any]] = {}
        self._rank: int | None = None
        self._row = 0

    def feed(self, totals: Mapping[int, Mapping[str, Any]]) -> str | None:
        """The report line once the same rank was the slowest for :data:`PERIODS` periods."""
        period = {}
        for rank, now in totals.items():
            before = self._previous.get(rank)
            steps = int(now["steps"]) - int(before["steps"]) if before else 0
            if before and steps >= MIN_STEPS:
                compute = now.get("compute_s")
                period[rank] = PerStep(
                    str(now.get("host", "?")),
                    (float(now["data_s"]) - float(before["data_s"])) / steps,
                    None if compute is None else float(compute),
                    (float(now["step_s"]) - float(before["step_s"])) / steps,
                )
        self._previous = dict(totals)
        found = slowest(period)
        self._row = self._row + 1 if found and found[0] == self._rank else int(bool(found))
        self._rank = found[0] if found else None
        if found is None or self._row < PERIODS:
            return None
        rank, fastest, gap, cause = found
        slow, fast = period[rank], period[fastest]
        step = statistics.median(entry.step_s for entry in period.values())
        return (
            f"ddpkit: straggler: rank {rank} (host {slow.host}) was the slowest for "
            f"{self._row} periods of {self.period_s:g} s: per step, data {_ms(slow.data_s)} ms + "
            f"compute {_ms(slow.compute_s)} ms, against {_ms(fast.data_s)} + "
            f"{_ms(fast.compute_s)} ms on the fastest rank (rank {fastest}); the job's step is "
            f"{_ms(step)} ms, so every rank waits about {_ms(gap)} ms a step for it; likely "
            f"cause: {cause}"
        )


class StragglerWatch:
    """The watchdog thread's hook: every period, post this rank's totals and, on rank 0, judge
    every rank's; store operations through the watchdog's link, so each is bounded and the
    watchdog's exit bound holds."""

    def __init__(self, link: StoreLink, period_s: float) -> None:
        self._link, self.rank, self.period_s = link, link.rank, period_s
        self._keys = [f"straggler/{rank}" for rank in range(link.world_size)]
        self._next = link.clock() + period_s
        self._host = socket.gethostname()
        self.judge = Judge(period_s) if link.rank == 0 else None

    def __call__(self, now: float) -> None:
        line = self.check(now)
        if line is not None:
            write_stderr(line + "\n")

    def check(self, now: float) -> str | None:
        """Every period: post, and on rank 0 read and judge; the report line or None."""
        if now < self._next:
            return None
        self._next = now + self.period_s
        self._link.post(self._keys[self.rank], json.dumps({**TIMES.totals(), "host": self._host}))
        if self.judge is None:
            return None
        read = self._link.read_all(self._keys)
        if read is None:
            return None
        return self.judge.feed({rank: json.loads(bytes(raw)) for rank, raw in enumerate(read)})


def attach(watchdog: Watchdog, period_s: float) -> None:
    """Run the report on ``watchdog``'s thread, once an interval (``init()``, after it started)."""
    watchdog.stragglers = StragglerWatch(watchdog.link, period_s)
