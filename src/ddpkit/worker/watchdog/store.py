"""The watchdog's link to the rendezvous store: markers, heartbeats and the order of departures.

No thread of its own: the watchdog's one thread calls :meth:`StoreLink.step` each time it wakes,
and a leaving rank's last calls (its marker) come from the thread that leaves, once the
watchdog's thread has stopped. The store is the watchdog's own connection, opened at ``init()``
(:func:`ddpkit.worker.watchdog.hooks.own_connection`), each operation bounded by its timeout
``op_timeout_s``: an operation that fails or times out means the store's host is gone, and no
further operation is made. The key layout under ``ddpkit/watchdog/`` and the order of the
operations matter: a leaving rank writes its marker ``exit/<rank>`` before appending to
``order`` and bumping ``events`` (peers poll ``events``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ddpkit.worker.rendezvous import batched
from ddpkit.worker.watchdog.beats import BeatJudge, StaleWatch, encode_stale
from ddpkit.worker.watchdog.policy import (
    HOOK_POLL_S,
    MAX_OP_TIMEOUT_S,
    Departure,
    beat_phase,
    describe_rank,
    judging_parts,
    on_grid,
    read_marker,
    read_who,
    stale_gap_s,
)


class KeyValue(Protocol):
    """The store operations the watchdog uses: none of them waits for a key to appear."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...  # only of keys known to exist
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def multi_set(self, keys: list[str], values: list[str]) -> None: ...
    def append(self, key: str, value: str) -> None: ...


class Stopping(Exception):
    """Raised by :meth:`StoreLink.call` once the watchdog stops: its work is not done."""


class StoreLink:
    """The store operations of one rank's watchdog; what they learn is read under ``_lock``."""

    def __init__(
        self,
        store: KeyValue,
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
        self._cut = cut  # ends an operation in flight at once (closes the connection's socket)
        # whether the store's host closed the connection: looked at before each round, so that
        # a host that left is learned of without an operation (torch logs a failed one with a
        # C++ stack trace on stderr)
        self._closed = closed
        self.op_timeout_s = op_timeout_s  # how long one store operation may block
        self.rank, self.world_size = rank, world_size
        self._interval_s, self._bound_s = interval_s, bound_s
        # how often the ranks other than 0 beat and poll (policy.beat_interval_for); rank 0
        # judges their counters every interval_s, so its own cadence keeps that one
        self.beat_interval_s = interval_s if beat_interval_s is None else beat_interval_s
        self._cadence_s = interval_s if rank == 0 else self.beat_interval_s
        self.host_rank, self.address = host_rank, address
        self._clock = clock
        self._lock = threading.Lock()
        self._departures: list[Departure] = []
        self._departed: set[int] = set()
        self._events_seen = 0
        self._order_seen = 0
        self.last_ok = clock()
        self.failure: Departure | None = None  # the store's host is gone: no more operations
        self.stopping = False  # the watchdog stops: call() refuses work
        self.host_left = False  # the store's host left on its own: its store goes next
        self._started = False
        self._next_beat = 0.0
        self._hurry_until = 0.0
        self._stale_watch: StaleWatch | None = None  # a hurry's
        self._stale_read_at, self._stale_ready = -1.0, False
        self._stale_published: str | None = None  # rank 0's: its first round publishes
        self._silent: list[Departure] | None = None
        self._beat_keys: list[str] | None = None
        parts = judging_parts(world_size, interval_s, self.beat_interval_s)
        self._judge = BeatJudge(rank, bound_s, world_size, parts)  # rank 0's
        self._listed_s = stale_gap_s(interval_s, self.beat_interval_s, parts)  # see hurry
        # the hang watchdog's: what this rank answers when asked, what it learned
        self.piece: Callable[[], Mapping[str, Any]] | None = None
        self.hang_asked = False
        self.hang_report: str | None = None

    @property
    def kv(self) -> KeyValue:
        """The store, for work handed to :meth:`call`."""
        return self._store

    def alive(self) -> bool:
        """Whether the store still answers."""
        return self.failure is None and not self.host_left

    def departures(self) -> list[Departure]:
        with self._lock:
            return list(self._departures)

    def store_departure(self, now: float) -> Departure | None:
        """The store's host as a departure, once an operation failed or timed out."""
        return self.failure

    def call(self, work: Callable[[], None], timeout_s: float) -> bool:
        """Run ``work`` (store operations, each bounded by ``op_timeout_s``) here and now;
        False when the store is gone or ``work`` failed (the store is then taken as gone).
        ``timeout_s`` is kept for the callers' sake: every operation is bounded already."""
        if self.stopping:
            raise Stopping
        if not self._answers():
            return False
        try:
            work()
        except Exception as error:
            self._fail(error)
            return False
        return True

    def cut(self) -> None:
        """End the operation in flight at once (the exit, after waiting ``op_timeout_s``)."""
        if self._cut is not None:
            self._cut()

    def presume_dead(self, ranks: Iterable[int | None]) -> None:
        """Kept for the excepthook: ranks it names need no more waiting for (no-op)."""

    def hurry(self, duration_s: float) -> None:
        """Poll at 20 Hz for a while; read rank 0's list of stale ranks (beats.StaleWatch): two
        keys at any size. Where rank 0's gap outlasts ``duration_s`` (past ~1,100 ranks)
        nobody is silent at once, unless rank 0 lists one (long silent) before the end."""
        gap_s = stale_gap_s(self._interval_s, self.beat_interval_s, 1)  # rank 0's own counter
        with self._lock:
            self._stale_watch = StaleWatch(self.rank, self.world_size, gap_s)
            self._silent = None if self._listed_s <= duration_s else []
            self._stale_read_at = -1.0
        self._hurry_until = self._clock() + duration_s

    def hurrying(self, now: float) -> bool:
        return now < self._hurry_until

    def silent(self) -> list[Departure] | None:
        """Ranks with no marker rank 0 listed as stale since a hurry began (None until one is
        found, or [] when none is expected within the hurry)."""
        with self._lock:
            return None if self._silent is None else list(self._silent)

    def named(self, cause: Departure | None, wait_s: float) -> None:
        """After a failed collective's excepthook named ``cause``: count this rank in
        ``named``; the store's host then keeps its store up (its process, and the store with
        it, ends next) until every other survivor counted itself, ``wait_s`` at most. Without
        it a survivor still reading the host's stale list found the store gone and named the
        host, a victim, instead of the rank that was killed."""
        if not self._answers():
            return
        culprits = 0 if cause is None or cause.rank in (None, self.rank) else 1
        others = self.world_size - 1 - culprits
        try:
            count = int(self._store.add("named", 1))
            if self.rank == self.host_rank:
                self._host_waits("named", others + 1, wait_s, count)
        except Exception as error:
            self._fail(error)

    def report_read(self, wait_s: float) -> None:
        """The store's host, about to end at a hang report (``DDPKIT_HANG_ACTION=end``): keep
        the store up (its process, and the store with it, ends next) until every other rank
        has read the report, ``wait_s`` at most (a rank that holds the GIL never reads it).
        Without it a rank still to poll found the store gone, and its peer watchdog ended it
        for a departed host instead of the report ending it."""
        if self.rank != self.host_rank or not self._answers():
            return
        try:
            self._host_waits("hang/read", self.world_size - 1, wait_s)
        except Exception as error:
            self._fail(error)

    def _host_waits(self, key: str, count: int, wait_s: float, seen: int | None = None) -> None:
        """The store's host keeps its store up until counter ``key`` reaches ``count``,
        ``wait_s`` at most (``seen``: its value already read)."""
        deadline = self._clock() + wait_s
        while (int(self._store.add(key, 0)) if seen is None else seen) < count:
            if self._clock() >= deadline:
                return
            time.sleep(HOOK_POLL_S)
            seen = None

    # the watchdog's thread

    def step(self, now: float) -> float:
        """Do the store work due at ``now`` (beat, judge, poll, a hurry's read); when the
        next is due. Each rank beats first at its phase of the interval (rank 0 judges at
        once); every beat key exists once rank 0's first round ran."""
        if not self._answers():
            return now + self._cadence_s
        try:
            if not self._started:
                self._started = True
                phase = 0.0 if self.rank == 0 else beat_phase(self.rank)
                self._next_beat = now + self._cadence_s * phase
                self._introduce()
                if self.rank == 0:  # every beat key exists from now on: multi_get never blocks
                    batched.multi_set(self._store, self._beats(), ["0"] * self.world_size)
            polls = now >= self._next_beat or self.hurrying(now)
            if now >= self._next_beat:
                self._store.add(f"beat/{self.rank}", 1)
                if self.rank == 0:
                    self._check_beats(now)
                self._next_beat = on_grid(self._next_beat, self._cadence_s, now)
            if polls:
                self._poll()
            if self.hurrying(now):
                self._read_stale()
            with self._lock:
                self.last_ok = self._clock()
        except Exception as error:
            if self.stopping:  # the exit cut the operation short: no judgment
                return now
            self._fail(error)
        return min(self._next_beat, now + HOOK_POLL_S) if self.hurrying(now) else self._next_beat

    def _answers(self) -> bool:
        """False once the store is gone (its host closed the connection: now a failure) or
        its host left (no operation then: one in flight as the store vanishes is logged)."""
        if self.failure is None and self._closed is not None and self._closed():
            self._fail(ConnectionError("the connection was closed by the store's host"))
        return self.failure is None and not self.host_left

    def _fail(self, error: BaseException) -> None:
        text = " ".join(str(error).split())[:200] or type(error).__name__
        with self._lock:
            if self.failure is None:
                self.failure = self._store_gone(
                    f"stopped answering ({type(error).__name__}: {text.splitlines()[0]})",
                    self.last_ok,
                )

    def _store_gone(self, what: str, left_at: float) -> Departure:
        if self.host_rank is None:
            return Departure(
                None,
                f"the job's store at {self.address}, hosted by the launcher,",
                f"{what}; the launcher probably exited",
                left_at=left_at,
            )
        return Departure(
            self.host_rank,
            f"rank {self.host_rank} (host of the job's store at {self.address})",
            f"is gone: the store {what}; rank {self.host_rank} probably exited, froze or lost "
            "its node",
            left_at=left_at,
        )

    def _introduce(self) -> None:
        """``who/<rank>``: the host, pid and node a heartbeat marker names."""
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                         "node": os.environ.get("SLURMD_NODENAME") or None})  # fmt: skip
        self._store.set(f"who/{self.rank}", me)

    def write_marker(self, rank: int, marker: Mapping[str, Any]) -> None:
        """``exit/<rank>``, then ``order``, then ``events``: readers rely on that order."""
        if self.failure is not None:
            return
        self._store.set(f"exit/{rank}", json.dumps(dict(marker)))
        self._store.append("order", f"{rank},")
        self._store.add("events", 1)

    def leave(self, marker: Mapping[str, Any]) -> None:
        """This rank's own marker, from the thread that leaves (the watchdog's has stopped)."""
        if not self._answers():
            return
        try:
            self.write_marker(self.rank, marker)
        except Exception as error:
            self._fail(error)

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
            departure = self._read_marker(rank, now)
            with self._lock:
                self._departed.add(rank)
                if rank != self.rank:
                    self._departures.append(departure)
            # a host that left on its own goes with its store; a victim first waits in its
            # excepthook (its store still up), for the stale list a hurry reads
            if rank == self.host_rank != self.rank and not departure.victim:
                self.host_left = True

    # the hang watchdog's keys: hang/claim, hang/ask, hang/piece/<rank>, hang/answered,
    # hang/report; the ask and the report bump ``events``, so they cost no poll of their own

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

    def claim_hang(self, ask: Mapping[str, Any]) -> bool:
        """The first rank to claim gathers: it asks every rank for its piece (its own first)."""
        if int(self._store.add("hang/claim", 1)) != 1:
            return False
        self._store.set("hang/ask", json.dumps(dict(ask)))
        self._answer()
        self._store.add("events", 1)
        return True

    def answered(self) -> int:
        return int(self._store.add("hang/answered", 0))

    def pieces(self) -> dict[int, dict[str, Any]]:
        """Every piece written so far (a rank that never answered is missing), a slice of
        ranks a call: a check and a get a rank outlast the gathering's wait at tens of
        thousands of ranks, and the report then came out without pieces."""
        keys = [f"hang/piece/{rank}" for rank in range(self.world_size)]
        ranks = batched.present(self._store, keys)
        found: dict[int, dict[str, Any]] = {}
        values = batched.multi_get(self._store, [keys[r] for r in ranks])
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

    def _read_marker(self, rank: int, now: float) -> Departure:
        return read_marker(rank, self._store.get(f"exit/{rank}"), now)

    def _who(self, rank: int) -> tuple[str | None, int | None, str | None]:
        """Host, pid and SLURM node name a rank introduced itself with."""
        key = f"who/{rank}"
        return read_who(self._store.get(key)) if self._store.check([key]) else (None, None, None)

    def _beats(self) -> list[str]:
        """Every rank's beat key, made once (rank 0 reads them every round)."""
        if self._beat_keys is None:
            self._beat_keys = [f"beat/{rank}" for rank in range(self.world_size)]
        return self._beat_keys

    def _check_beats(self, now: float) -> None:
        """Rank 0: mark the ranks whose counter has not moved for the bound, publish those still
        for a gap; a part of the counters a round (BeatJudge.next_part). Every beat key exists
        (step): no check of N keys a round."""
        start, end = self._judge.next_part()
        values = batched.multi_get(self._store, self._beats()[start:end])  # see batched
        for rank, age_s in self._judge.still(values, now, start):
            if rank in self._departed:  # it left with a marker of its own
                continue
            host, pid, node = self._who(rank)
            how = f"stopped sending heartbeats {age_s:.0f} s ago (killed, or frozen?)"
            marker = {"host": host, "pid": pid, "how": how, "age_s": age_s, "node": node}
            self.write_marker(rank, marker)
        listed = self._judge.stale(now, self._listed_s)
        stale = encode_stale([rank for rank in listed if rank not in self._departed])
        if stale != self._stale_published:  # within the round beat/0 counts: see StaleWatch
            self._store.set("stale", stale)
            self._stale_published = stale

    def _read_stale(self) -> None:
        """A hurry's read of rank 0's round counter and stale list, 4 times a round at most."""
        now = self._clock()
        with self._lock:
            watch, found_already = self._stale_watch, bool(self._silent)
        soon = now - self._stale_read_at < self._interval_s / 4
        if watch is None or found_already or soon:
            return
        self._stale_read_at = now
        keys = ["beat/0", "stale"]
        if not self._stale_ready:  # from rank 0's first round on, both exist
            self._stale_ready = self._store.check(keys)
            if not self._stale_ready:
                return
        ranks = watch.read(now, *self._store.multi_get(keys))
        found = []
        for rank in ranks or []:
            if rank not in self._departed:
                host, pid, node = self._who(rank)
                who, how = describe_rank(rank, host, pid), "stopped sending heartbeats (killed?)"
                found.append(Departure(rank, who, how, left_at=now, node=node))
        if found:
            with self._lock:
                self._silent = found
