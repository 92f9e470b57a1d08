"""The watchdog's store operations: markers, heartbeats, their judging, and the hang keys.

Called by the watchdog's thread (:meth:`StoreLink.step`), and for a leaving rank's marker by
the thread that leaves, once that one stopped. Each operation goes over the watchdog's own
connection (:func:`~ddpkit.worker.watchdog.hooks.own_connection`), bounded by ``op_timeout_s``:
one that fails or times out means the store's host is gone, and no further one is made. A
leaving rank writes ``exit/<rank>``, then appends to ``order``, then bumps ``events`` (polled).
"""

from __future__ import annotations

import json
import math
import operator
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from itertools import compress
from typing import Any

from ddpkit.worker.rendezvous import batched
from ddpkit.worker.watchdog.policy import (
    HOOK_POLL_S,
    MAX_OP_TIMEOUT_S,
    Departure,
    describe_rank,
    read_marker,
    read_who,
)


class BeatJudge:
    """Rank 0's reading of the beat counters: when each last moved (``own`` is never judged).
    It runs on the training process's GIL every interval, so in C's loops where it can."""

    def __init__(self, own: int, bound_s: float) -> None:
        self._own, self._bound_s = own, bound_s
        self._seen: list[bytes] | None = None
        self._moved: list[float] = []

    def still(self, values: list[bytes], now: float) -> list[tuple[int, float]]:
        """The ranks whose counter has not moved for the bound, with how long, each once (a
        counter that moves again does not bring a rank judged gone back)."""
        if self._seen is None:  # the first round: every counter counts from now
            self._seen, self._moved = list(values), [now] * len(values)
            self._moved[self._own] = math.inf
            return []
        moved = self._moved
        for rank in compress(range(len(values)), map(operator.ne, values, self._seen)):
            if moved[rank] != math.inf:
                moved[rank] = now
        self._seen = list(values)
        since = now - self._bound_s
        found = [
            (rank, now - moved[rank])
            for rank in compress(range(len(moved)), map(since.__ge__, moved))
        ]
        for rank, _ in found:
            moved[rank] = math.inf
        return found


class Stopping(Exception):
    """Raised by :meth:`StoreLink.call` once the watchdog stops: its work is not done."""


class StoreLink:
    """The store operations of one rank's watchdog; what they learn is read under ``_lock``."""

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        world_size: int,
        interval_s: float,
        bound_s: float,
        host_rank: int | None,
        address: str,
        clock: Callable[[], float],
        op_timeout_s: float = MAX_OP_TIMEOUT_S,
        beat_interval_s: float | None = None,
        cut: Callable[[], None] | None = None,
        closed: Callable[[], bool] | None = None,
    ) -> None:
        self._store = store
        self._cut = cut  # ends an operation in flight at once (shuts its socket down)
        # whether the host closed the connection, looked at before each round: a host that
        # left is learned of without a failed operation (torch logs those with a stack trace)
        self._closed = closed
        self.op_timeout_s = op_timeout_s
        self.rank, self.world_size, self._interval_s = rank, world_size, interval_s
        self.beat_interval_s = beat_interval_s or interval_s
        self._cadence_s = interval_s if rank == 0 else self.beat_interval_s  # rank 0 judges
        self.host_rank, self.address, self._clock = host_rank, address, clock
        self._lock = threading.Lock()
        self._departures: list[Departure] = []
        self._departed: set[int] = set()
        self._events_seen = self._order_seen = 0
        self.last_ok = clock()
        self.failure: Departure | None = None  # the store's host is gone: no more operations
        self.stopping = False  # the watchdog stops: call() refuses work
        self.host_left = False  # the store's host left on its own: its store goes next
        self._started, self._next_beat = False, -math.inf
        self._judge = BeatJudge(rank, bound_s)  # rank 0's
        # the hang watchdog's: what this rank answers when asked, what it learned
        self.piece: Callable[[], Mapping[str, Any]] | None = None
        self.hang_asked = False
        self.hang_report: str | None = None

    @property
    def kv(self) -> Any:
        """The store, for work handed to :meth:`call`."""
        return self._store

    def alive(self) -> bool:
        return self.failure is None and not self.host_left

    def departures(self) -> list[Departure]:
        with self._lock:
            return list(self._departures)

    def call(self, work: Callable[[], Any]) -> Any:
        """``work()``'s result (store operations), or None when the store is gone or ``work``
        failed (the store is then taken as gone); raises :class:`Stopping` once stopping."""
        if self.stopping:
            raise Stopping
        return self._guarded(work)

    def cut(self) -> None:
        """End the operation in flight at once (the exit, after waiting ``op_timeout_s``)."""
        if self._cut is not None:
            self._cut()

    def named(self, cause: Departure | None, wait_s: float) -> None:
        """After a failed collective's excepthook named ``cause``: count this rank in
        ``named``; the store's host keeps its store up until every other survivor counted
        itself, ``wait_s`` at most (else a survivor still waiting for the culprit's marker
        found the store gone and named the host, a victim, instead)."""
        culprits = 0 if cause is None or cause.rank in (None, self.rank) else 1
        seen = self._guarded(lambda: int(self._store.add("named", 1)))
        if seen is not None and self.rank == self.host_rank:
            self._host_waits("named", self.world_size - culprits, wait_s, seen)

    def report_read(self, wait_s: float) -> None:
        """The store's host, about to end at a hang report: keep the store up until every
        other rank has read the report, ``wait_s`` at most (else a rank still to poll found
        the store gone, and its watchdog ended it for a departed host)."""
        if self.rank == self.host_rank:
            self._host_waits("hang/read", self.world_size - 1, wait_s)

    def _host_waits(self, key: str, count: int, wait_s: float, seen: int | None = None) -> None:
        """Keep the store up until counter ``key`` reaches ``count``, ``wait_s`` at most."""

        def read() -> int | None:
            value: int | None = self._guarded(lambda: int(self._store.add(key, 0)))
            return value

        deadline = self._clock() + wait_s
        seen = read() if seen is None else seen
        while seen is not None and seen < count and self._clock() < deadline:
            time.sleep(HOOK_POLL_S)
            seen = read()

    def _guarded(self, work: Callable[[], Any]) -> Any:
        """``work()``'s result, or None once the store is gone (or when it fails)."""
        if not self._answers():
            return None
        try:
            return work()
        except Exception as error:
            self._fail(error)
            return None

    # the watchdog's thread

    def step(self, now: float) -> float:
        """Do the store work due at ``now`` (beat, judge, poll); when the next is due. Every
        beat key exists once rank 0's first step ran."""
        if not self._answers():
            return now + self._cadence_s
        try:
            if not self._started:
                self._started = True
                self._introduce()
                if self.rank == 0:  # every beat key exists from now on: multi_get never blocks
                    keys = [f"beat/{rank}" for rank in range(self.world_size)]
                    batched.multi_set(self._store, keys, ["0"] * self.world_size)
            if now >= self._next_beat:
                self._store.add(f"beat/{self.rank}", 1)
                if self.rank == 0:
                    self._check_beats(now)
                self._next_beat = now + self._cadence_s
                self._poll()
            with self._lock:
                self.last_ok = self._clock()
        except Exception as error:
            if self.stopping:  # the exit cut the operation short: no judgment
                return now
            self._fail(error)
        return self._next_beat

    def _answers(self) -> bool:
        """False once the store is gone (its host closed the connection: now a failure) or
        its host left (no operation then: one in flight as the store vanishes is logged)."""
        if self.failure is None and self._closed is not None and self._closed():
            self._fail(ConnectionError("the connection was closed by the store's host"))
        return self.alive()

    def _fail(self, error: BaseException) -> None:
        text = " ".join(str(error).split())[:200] or type(error).__name__
        what = f"stopped answering ({type(error).__name__}: {text})"
        if self.host_rank is None:
            gone = Departure(
                None,
                f"the job's store at {self.address}, hosted by the launcher,",
                f"{what}; the launcher probably exited",
                left_at=self.last_ok,
            )
        else:
            gone = Departure(
                self.host_rank,
                f"rank {self.host_rank} (host of the job's store at {self.address})",
                f"is gone: the store {what}; rank {self.host_rank} probably exited, froze or "
                "lost its node",
                left_at=self.last_ok,
            )
        with self._lock:
            self.failure = self.failure or gone

    def _introduce(self) -> None:
        """``who/<rank>``: the host, pid and node a heartbeat marker names."""
        node = os.environ.get("SLURMD_NODENAME") or None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "node": node}
        self._store.set(f"who/{self.rank}", json.dumps(me))

    def write_marker(self, rank: int, marker: Mapping[str, Any]) -> None:
        """``exit/<rank>``, then ``order``, then ``events``: readers rely on that order."""
        if self.failure is None:
            self._store.set(f"exit/{rank}", json.dumps(dict(marker)))
            self._store.append("order", f"{rank},")
            self._store.add("events", 1)

    def leave(self, marker: Mapping[str, Any]) -> None:
        """This rank's own marker, from the thread that leaves (the watchdog's has stopped)."""
        self._guarded(lambda: self.write_marker(self.rank, marker))

    def _poll(self) -> None:
        events = int(self._store.add("events", 0))
        if events == self._events_seen:
            return
        self._events_seen = events
        if self.piece is not None:
            self._hang_poll()
        if not self._store.check(["order"]):  # an event of the hang watchdog's only
            return
        ranks = [int(item) for item in self._store.get("order").decode().split(",") if item]
        fresh, self._order_seen = ranks[self._order_seen :], len(ranks)
        now = self._clock()
        for rank in fresh:
            if rank in self._departed:
                continue
            departure = read_marker(rank, self._store.get(f"exit/{rank}"), now)
            with self._lock:
                self._departed.add(rank)
                if rank != self.rank:
                    self._departures.append(departure)
            # a host that left on its own goes with its store; a victim first waits in its
            # excepthook (its store still up) for the culprit's marker
            if rank == self.host_rank != self.rank and not departure.victim:
                self.host_left = True

    def _who(self, rank: int) -> tuple[str | None, int | None, str | None]:
        """Host, pid and SLURM node name a rank introduced itself with."""
        key = f"who/{rank}"
        return read_who(self._store.get(key)) if self._store.check([key]) else (None, None, None)

    def _check_beats(self, now: float) -> None:
        """Rank 0: mark the ranks whose counter has not moved for the bound (the counters
        read a slice of keys a call: see ``batched``)."""
        keys = [f"beat/{rank}" for rank in range(self.world_size)]
        for rank, age_s in self._judge.still(batched.multi_get(self._store, keys), now):
            if rank in self._departed:  # it left with a marker of its own
                continue
            host, pid, node = self._who(rank)
            how = f"stopped sending heartbeats {age_s:.0f} s ago (killed, or frozen?)"
            marker = {"host": host, "pid": pid, "how": how, "age_s": age_s, "node": node}
            self.write_marker(rank, marker)

    def silent(self, judge: BeatJudge, now: float) -> Departure | None:
        """A rank without a marker whose counter ``judge`` saw stand still: a failed
        collective's survivor reads every counter while it waits for a name."""
        keys = [f"beat/{rank}" for rank in range(self.world_size)]

        def read() -> Departure | None:
            if not batched.check(self._store, keys):  # before rank 0's first round
                return None
            for rank, _ in judge.still(batched.multi_get(self._store, keys), now):
                if rank not in self._departed:
                    host, pid, node = self._who(rank)
                    who = describe_rank(rank, host, pid)
                    how = "stopped sending heartbeats (killed?)"
                    return Departure(rank, who, how, left_at=now, node=node)
            return None

        found: Departure | None = self._guarded(read)
        return found

    # the hang watchdog's keys: hang/claim, hang/ask, hang/piece/<rank>, hang/answered,
    # hang/report, hang/read; the ask and the report bump ``events``: no poll of their own

    def _hang_poll(self) -> None:
        if not self.hang_asked and self._store.check(["hang/ask"]):
            self._answer()
        if self.hang_report is None and self._store.check(["hang/report"]):
            text = self._store.get("hang/report").decode(errors="replace")
            with self._lock:
                self.hang_report = text
            self._store.add("hang/read", 1)  # the host may end once every rank has it

    def _answer(self) -> None:
        self.hang_asked = True
        if self.piece is not None:
            self._store.set(f"hang/piece/{self.rank}", json.dumps(dict(self.piece())))
            self._store.add("hang/answered", 1)

    def claim_hang(self) -> bool:
        """The first rank to claim gathers: it asks every rank for its piece (its own first)."""
        if int(self._store.add("hang/claim", 1)) != 1:
            return False
        self._store.set("hang/ask", json.dumps({"by": self.rank}))
        self._answer()
        self._store.add("events", 1)
        return True

    def answered(self) -> int:
        return int(self._store.add("hang/answered", 0))

    def pieces(self) -> dict[int, dict[str, Any]]:
        """Every piece written so far (a rank that never answered is missing), read a slice
        of ranks a call."""
        keys = [f"hang/piece/{rank}" for rank in range(self.world_size)]
        ranks = batched.present(self._store, keys)
        values = batched.multi_get(self._store, [keys[rank] for rank in ranks])
        found: dict[int, dict[str, Any]] = {}
        for rank, raw in zip(ranks, values, strict=True):
            try:
                found[rank] = dict(json.loads(raw.decode()))
            except (ValueError, TypeError):
                continue
        return found

    def publish_report(self, text: str) -> None:
        self._store.set("hang/report", text)
        self._store.add("events", 1)
        with self._lock:
            self.hang_report = text
