"""The watchdog's store operations, on its own connection, each bounded by ``op_timeout_s``: one
that fails or times out means the store's host is gone."""

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
from ddpkit.worker.watchdog.policy import Departure, describe_rank, read_marker, read_who


class BeatJudge:
    """When each beat counter last moved (``own`` is never judged), in C's loops where it can:
    rank 0 runs it on the training process's GIL."""

    def __init__(self, own: int, bound_s: float) -> None:
        self._own, self._bound_s = own, bound_s
        self._seen: list[bytes] | None = None
        self._moved: list[float] = []

    def still(self, values: list[bytes], now: float) -> list[tuple[int, float]]:
        """The ranks whose counter has not moved for the bound, with how long, each once."""
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
        found = [(r, now - moved[r]) for r in compress(range(len(moved)), map(since.__ge__, moved))]
        for rank, _ in found:
            moved[rank] = math.inf
        return found


class Stopping(Exception):
    """Raised by :meth:`StoreLink.call` once the watchdog stops."""


class StoreLink:
    """One rank's watchdog store operations; what they learn is read under ``_lock``. A leaving
    rank writes ``exit/<rank>``, then appends to ``order``, then bumps ``events`` (polled)."""

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
        clock: Callable[[], float] = time.monotonic,
        op_timeout_s: float = 10.0,
        beat_interval_s: float | None = None,
        cut: Callable[[], None] | None = None,
        closed: Callable[[], bool] | None = None,
    ) -> None:
        # cut: ends an operation in flight at once; closed: whether the host closed the
        # connection, learned without a failed operation (torch logs those with a stack trace)
        self._store, self._cut, self._closed, self.op_timeout_s = store, cut, closed, op_timeout_s
        self.rank, self.world_size = rank, world_size
        self._beats = [f"beat/{rank}" for rank in range(world_size)]
        self.beat_interval_s = beat_interval_s or interval_s
        self._cadence_s = interval_s if rank == 0 else self.beat_interval_s  # rank 0 judges
        self.host_rank, self.address, self.clock = host_rank, address, clock
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
        self.piece: Callable[[], Mapping[str, Any]] | None = None  # the hang watchdog's answer
        self.hang_asked = False
        self.hang_report: str | None = None

    def departures(self) -> list[Departure]:
        with self._lock:
            return list(self._departures)

    def call(self, work: Callable[[], Any]) -> Any:
        """``work()``'s result, None once the store is gone; :class:`Stopping` once stopping."""
        if self.stopping:
            raise Stopping
        return self._guarded(work)

    def post(self, key: str, value: str) -> None:
        """Set ``key`` to ``value``, bounded (nothing once the store is gone)."""
        self.call(lambda: self._store.set(key, value))

    def read_all(self, keys: list[str]) -> list[bytes] | None:
        """Every key's value once all are set (multi_get blocks until then); bounded, else None."""
        store = self._store
        read = self.call(lambda: batched.check(store, keys) and batched.multi_get(store, keys))
        return read or None

    def cut(self) -> None:
        """End the operation in flight at once (the exit, after waiting ``op_timeout_s``)."""
        if self._cut is not None:
            self._cut()

    def named(self, cause: Departure | None, wait_s: float) -> None:
        """After the excepthook named ``cause``: count this rank in ``named``."""
        culprits = 0 if cause is None or cause.rank in (None, self.rank) else 1
        self._guarded(lambda: self._store.add("named", 1))
        self.host_waits("named", self.world_size - culprits, wait_s)

    def host_waits(self, key: str, count: int, wait_s: float) -> None:
        """On the store's host, about to end: keep the store up until counter ``key`` reaches
        ``count``, ``wait_s`` at most (the survivors still naming the culprit, the ranks still
        to read a hang report: else they found the store gone, and blamed its host)."""
        deadline = self.clock() + wait_s
        while self.rank == self.host_rank and self.clock() < deadline:
            seen = self._guarded(lambda: int(self._store.add(key, 0)))
            if seen is None or seen >= count:
                return
            time.sleep(0.05)

    def _guarded(self, work: Callable[[], Any]) -> Any:
        """``work()``'s result, None once the store is gone (or when it fails)."""
        if not self._answers():
            return None
        try:
            return work()
        except Exception as error:
            self._fail(error)
            return None

    def step(self, now: float) -> float:
        """Do the store work due at ``now`` (beat, judge, poll); when the next is due."""
        if not self._answers():
            return now + self._cadence_s
        try:
            if not self._started:
                self._started = True
                self._introduce()
                if self.rank == 0:  # every beat key exists from now on: multi_get never blocks
                    batched.multi_set(self._store, self._beats, ["0"] * self.world_size)
            if now >= self._next_beat:
                self._store.add(f"beat/{self.rank}", 1)
                if self.rank == 0:
                    self._check_beats(now)
                self._next_beat = now + self._cadence_s
                self._poll()
            with self._lock:
                self.last_ok = self.clock()
        except Exception as error:
            if self.stopping:  # the exit cut the operation short: no judgment
                return now
            self._fail(error)
        return self._next_beat

    def _answers(self) -> bool:
        """False once the store is gone or its host left (logged if mid-operation)."""
        if self.failure is None and self._closed is not None and self._closed():
            self._fail(ConnectionError("the connection was closed by the store's host"))
        return self.failure is None and not self.host_left

    def _fail(self, error: BaseException) -> None:
        text = " ".join(str(error).split())[:200] or type(error).__name__
        what = f"stopped answering ({type(error).__name__}: {text})"
        rank = self.host_rank
        if rank is None:
            who = f"the job's store at {self.address}, hosted by the launcher,"
            how = f"{what}; the launcher probably exited"
        else:
            who = f"rank {rank} (host of the job's store at {self.address})"
            how = f"is gone: the store {what}; rank {rank} probably exited, froze or lost its node"
        with self._lock:
            self.failure = self.failure or Departure(rank, who, how, left_at=self.last_ok)

    def _introduce(self) -> None:
        """``who/<rank>``: the host, pid and node a heartbeat marker names."""
        node = os.environ.get("SLURMD_NODENAME") or None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "node": node}
        self._store.set(f"who/{self.rank}", json.dumps(me))

    def write_marker(self, rank: int, marker: Mapping[str, Any]) -> None:
        if self.failure is None:
            self._store.set(f"exit/{rank}", json.dumps(dict(marker)))
            self._store.append("order", f"{rank},")
            self._store.add("events", 1)

    def leave(self, marker: Mapping[str, Any]) -> None:
        """This rank's own marker, from the thread that leaves once the watchdog's stopped."""
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
        now = self.clock()
        for rank in fresh:
            if rank in self._departed:
                continue
            departure = read_marker(rank, self._store.get(f"exit/{rank}"), now)
            with self._lock:
                self._departed.add(rank)
                if rank != self.rank:
                    self._departures.append(departure)
            # a host that left on its own goes with its store (a victim's stays up a while)
            if rank == self.host_rank != self.rank and not departure.victim:
                self.host_left = True

    def who(self, rank: int) -> tuple[str | None, int | None, str | None]:
        key = f"who/{rank}"
        return read_who(self._store.get(key)) if self._store.check([key]) else (None, None, None)

    def _check_beats(self, now: float) -> None:
        """Rank 0: mark the ranks whose counter has not moved for the bound."""
        for rank, age_s in self._judge.still(batched.multi_get(self._store, self._beats), now):
            if rank in self._departed:  # it left with a marker of its own
                continue
            host, pid, node = self.who(rank)
            how = f"stopped sending heartbeats {age_s:.0f} s ago (killed, or frozen?)"
            marker = {"host": host, "pid": pid, "how": how, "age_s": age_s, "node": node}
            self.write_marker(rank, marker)

    def silent(self, judge: BeatJudge, now: float) -> Departure | None:
        """A rank with no marker whose counter ``judge`` saw stand still (a survivor's culprit)."""

        def read() -> Departure | None:
            if not batched.check(self._store, self._beats):  # before rank 0's first round
                return None
            for rank, _ in judge.still(batched.multi_get(self._store, self._beats), now):
                if rank not in self._departed:
                    host, pid, node = self.who(rank)
                    who = describe_rank(rank, host, pid)
                    how = "stopped sending heartbeats (killed?)"
                    return Departure(rank, who, how, left_at=now, node=node)
            return None

        return self._guarded(read)  # type: ignore[no-any-return]

    # the hang report's keys (hang/...): its ask and report bump ``events``, no poll of their own

    def _hang_poll(self) -> None:
        if not self.hang_asked and self._store.check(["hang/ask"]):
            self._answer()
        if self.hang_report is None and self._store.check(["hang/report"]):
            text = self._store.get("hang/report").decode(errors="replace")
            with self._lock:
                self.hang_report = text
            self._store.add("hang/read", 1)

    def _answer(self) -> None:
        self.hang_asked = True
        if self.piece is not None:
            self._store.set(f"hang/piece/{self.rank}", json.dumps(dict(self.piece())))
            self._store.add("hang/answered", 1)

    def claim_hang(self) -> bool:
        """The first rank to claim gathers: it asks every rank for its piece."""
        if int(self._store.add("hang/claim", 1)) != 1:
            return False
        self._store.set("hang/ask", json.dumps({"by": self.rank}))
        self._answer()
        self._store.add("events", 1)
        return True

    def answered(self) -> int:
        return int(self._store.add("hang/answered", 0))

    def pieces(self) -> dict[int, dict[str, Any]]:
        """Every piece written so far (a rank that never answered is missing)."""
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
