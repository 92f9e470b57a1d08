"""The watchdog's link to the rendezvous store: markers, heartbeats and the order of departures.

Every store operation runs on one daemon thread (``ddpkit-watchdog-store``), so that the
judging thread never waits on a store whose host froze. The key layout under
``ddpkit/watchdog/`` and the order of the operations matter: a leaving rank writes its marker
``exit/<rank>`` before appending to ``order`` and bumping ``events`` (peers poll ``events``).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ddpkit.worker.rendezvous import batched
from ddpkit.worker.watchdog.beats import BeatJudge, StaleWatch, encode_stale
from ddpkit.worker.watchdog.policy import (
    HOOK_POLL_S,
    STORE_THREAD_NAME,
    Departure,
    beat_phase,
    describe_rank,
    judging_parts,
    on_grid,
    read_marker,
    read_who,
    stale_gap_s,
)

# --- the store side -----------------------------------------------------------------------------


DEFAULT_OP_TIMEOUT_S = 10.0  # a store operation's bound when the link has its own connection


class KeyValue(Protocol):
    """The store operations the watchdog uses: none of them waits for a key to appear."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...  # only of keys known to exist
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def multi_set(self, keys: list[str], values: list[str]) -> None: ...
    def append(self, key: str, value: str) -> None: ...


@dataclass
class _Request:
    work: Callable[[], None]
    done: threading.Event


class StoreLink:
    """The one thread that talks to the store; what it learns is read under ``_lock``."""

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
        op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
        beat_interval_s: float | None = None,
        connect: Callable[[], KeyValue | None] | None = None,
    ) -> None:
        self._store = store
        # The link's own connection, made by its thread (None: keep ``store``) at its first
        # beat's phase (rank 0: its first judging round, an interval in; a request or a hurry
        # bring it sooner; none once it leaves), the rank having introduced itself at start:
        # thousands of ranks let go by one barrier do not add to the burst init() waits behind.
        self._connect = connect
        self._connecting, self._introduced = connect is not None, False
        self.op_timeout_s = op_timeout_s  # how long one store operation may block
        self.rank, self.world_size = rank, world_size
        self._interval_s, self._bound_s = interval_s, bound_s
        # how often the ranks other than 0 beat and poll (policy.beat_interval_for); rank 0
        # judges their counters every interval_s, so its own loop keeps that one
        self.beat_interval_s = interval_s if beat_interval_s is None else beat_interval_s
        self._cadence_s = interval_s if rank == 0 else self.beat_interval_s
        # the gap to the first beat: the others spread their beats over the interval
        self._first_gap_s = self._cadence_s * (1.0 if rank == 0 else beat_phase(rank))
        self.host_rank, self.address = host_rank, address
        self._clock = clock
        self._lock = threading.Lock()
        self._departures: list[Departure] = []
        self._departed: set[int] = set()
        self._events_seen = 0
        self._order_seen = 0
        self.last_ok = clock()
        self.failure: Departure | None = None
        self.released = False  # the store's host left: no more store operations
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.leaving = False  # the rank says it leaves (Watchdog.stop): no own connection now
        self._hurry_until = 0.0
        self._stale_watch: StaleWatch | None = None  # a hurry's
        self._stale_read_at, self._stale_ready = -1.0, False
        self._stale_published: str | None = None  # rank 0's: its first round publishes
        self._silent: list[Departure] | None = None
        self._beat_keys: list[str] | None = None
        parts = judging_parts(world_size, interval_s, self.beat_interval_s)
        self._judge = BeatJudge(rank, bound_s, world_size, parts)  # rank 0's
        self._listed_s = stale_gap_s(interval_s, self.beat_interval_s, parts)  # see hurry
        self._presumed_dead: set[int] = set()  # ranks rank 0 wrote a heartbeat marker for
        # the hang watchdog's: what this rank answers when asked, what it learned
        self.piece: Callable[[], Mapping[str, Any]] | None = None
        self.hang_asked = False
        self.hang_report: str | None = None
        self._thread = threading.Thread(target=self._run, name=STORE_THREAD_NAME, daemon=True)

    # called from other threads

    @property
    def kv(self) -> KeyValue:
        """The store, for work handed to :meth:`call` (it runs on the store thread): read it
        there, not before: the thread swaps in its own connection before its first call."""
        return self._store

    def start(self) -> None:
        if self._connect is not None:
            try:  # who it is, known from init() on; one set over the group's connection
                self._introduce()
                self._introduced = True
            except Exception:  # its thread introduces it once connected
                pass
        self._thread.start()

    def stop(self, wait_s: float | None = None) -> None:
        """End the thread after its last store operation (waits up to ``wait_s`` for it,
        default: two operations' timeout, the one in flight and the ``done`` mark).

        The wait must outlast the operation in flight: this runs at exit, and a daemon thread
        still inside the store's C++ call when the interpreter finalizes is killed by CPython
        as it returns (``pthread_exit`` unwinding through a ``noexcept`` pybind11 frame):
        ``terminate called without an active exception``, SIGABRT, and the launcher fails a
        job that had finished (seen at 16 ranks on 2 cores, where a call took over a second).
        So must a try of the thread's own connect (each bounded by half an operation's timeout,
        none begun once the rank leaves, see hooks.own_connection); one blocked for good on a
        frozen host never comes back.
        """
        self.leaving = True
        self._stopping.set()
        self._wake.set()
        if wait_s is None:
            wait_s = 2 * self.op_timeout_s + 1.0
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(wait_s)

    def alive(self) -> bool:
        """Whether the store thread still talks to the store."""
        return self._thread.is_alive() and not self.released and self.failure is None

    def departures(self) -> list[Departure]:
        with self._lock:
            return list(self._departures)

    def store_departure(self, now: float) -> Departure | None:
        """The store's host as a departure: it failed, or has not answered for the bound."""
        with self._lock:
            if self.failure is not None or self.released:
                return self.failure
            if self._connecting:  # bounded by the store's own timeout, then a failure
                return None
            silent_s = now - self.last_ok
        if silent_s < self._bound_s:
            return None
        return self._store_gone(f"has not answered for {silent_s:.0f} s", self.last_ok)

    def call(self, work: Callable[[], None], timeout_s: float) -> bool:
        """Run ``work`` on the store thread; False if it could not finish within the timeout."""
        if not self._thread.is_alive():
            return False
        request = _Request(work, threading.Event())
        self._requests.put(request)
        self._wake.set()
        return request.done.wait(timeout_s)

    def presume_dead(self, ranks: Iterable[int | None]) -> None:
        """Ranks the host's ``linger`` should not wait for."""
        with self._lock:
            self._presumed_dead.update(rank for rank in ranks if rank is not None)

    def hurry(self, duration_s: float) -> None:
        """Poll at 20 Hz for a while; read rank 0's list of stale ranks (beats.StaleWatch): two
        keys at any size (each survivor read every counter twice until 2026-11-27: N x N keys
        while the job failed). Where rank 0's gap outlasts ``duration_s`` (past ~1,100 ranks)
        nobody is silent at once, unless rank 0 lists one (long silent) before the end."""
        gap_s = stale_gap_s(self._interval_s, self.beat_interval_s, 1)  # rank 0's own counter
        with self._lock:
            self._stale_watch = StaleWatch(self.rank, self.world_size, gap_s)
            self._silent = None if self._listed_s <= duration_s else []
            self._stale_read_at = -1.0
        self._hurry_until = self._clock() + duration_s
        self._wake.set()

    def silent(self) -> list[Departure] | None:
        """Ranks with no marker rank 0 listed as stale since a hurry began (None until one is
        found, or [] when none is expected within the hurry)."""
        with self._lock:
            return None if self._silent is None else list(self._silent)

    # the thread

    def _run(self) -> None:
        try:
            # Each rank connects and beats first at its phase (rank 0 then judges at once), the
            # others poll from their next wake: nothing of the watchdog's in init's burst at the
            # store (a counter is judged from rank 0's first round on, whatever it holds then).
            polls = self.rank == 0
            next_beat = self._clock() + (0.0 if polls else self._first_gap_s)
            if self._connect is not None:  # not once leaving: the shared one ends it
                self._wake.wait(self._first_gap_s)
            if self._connect is not None and not self.leaving:
                own = self._connect()
                if own is not None:
                    self._store = own
            with self._lock:  # the store's silence counts from here: a slow connect is not it
                self.last_ok, self._connecting = self._clock(), False
            if not self._introduced:
                self._introduce()
            if self.rank == 0:  # every beat key exists from now on: multi_get never blocks.
                # A round trip a slice of keys: not one per rank (N adds made rank 0 ready after
                # ~N store calls), nor one call of N keys (the store's cost grows faster than N).
                # Setting a counter some rank already bumped back to 0 is harmless: the judges
                # look for a counter that does not move, and none has read beat/0 yet (rank 0
                # bumps it only after this; they read every beat key or none).
                batched.multi_set(self._store, self._beats(), ["0"] * self.world_size)
            while True:
                self._serve()
                if self._stopping.is_set() or self.released:
                    break
                now = self._clock()
                if now >= next_beat:
                    self._store.add(f"beat/{self.rank}", 1)
                    if self.rank == 0:
                        self._check_beats(now)
                    next_beat = on_grid(next_beat, self._cadence_s, now)
                if polls:
                    self._poll()
                polls = True
                hurrying = self._clock() < self._hurry_until
                if hurrying:
                    self._read_stale()
                with self._lock:
                    self.last_ok = self._clock()
                wait_s = HOOK_POLL_S if hurrying else max(0.0, next_beat - self._clock())
                self._wake.wait(wait_s)
                self._wake.clear()
            self._store.add("done", 1)  # this rank's last store operation (see linger)
        except Exception as error:
            self._fail(error)
        finally:
            self._drain()

    def _serve(self) -> None:
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return
            try:
                request.work()
            finally:
                request.done.set()

    def _drain(self) -> None:
        """Release whoever waits on a request the dead thread will never run."""
        while True:
            try:
                self._requests.get_nowait().done.set()
            except queue.Empty:
                return

    def _fail(self, error: BaseException) -> None:
        text = " ".join(str(error).split())[:200] or type(error).__name__
        with self._lock:
            if self.failure is None and not self.released:
                self.failure = self._store_gone(
                    f"stopped answering ({type(error).__name__}: {text})", self._clock()
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
        if self.released or self.failure is not None:
            return
        self._store.set(f"exit/{rank}", json.dumps(dict(marker)))
        self._store.append("order", f"{rank},")
        self._store.add("events", 1)

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
        host_left = self.host_rank in self._departed and self.host_rank != self.rank
        if host_left and self._store.check(["closing"]):  # it waits for our "done", then goes
            with self._lock:
                self.released = True

    # the hang watchdog's keys: hang/claim, hang/ask, hang/piece/<rank>, hang/answered,
    # hang/report; the ask and the report bump ``events``, so they cost no poll of their own

    def _hang_poll(self) -> None:
        if not self.hang_asked and self._store.check(["hang/ask"]):
            self._answer()
        if self.hang_report is None and self._store.check(["hang/report"]):
            text = self._store.get("hang/report").decode(errors="replace")
            with self._lock:
                self.hang_report = text

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
        ranks a call: a check and a get a rank (74 us on this machine's loopback) outlast the
        gathering's wait for one store operation (5 s) at tens of thousands of ranks (~67,000
        there, fewer across a network), and the report then came out without pieces."""
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
        """Every rank's beat key, made once: at 98,304 ranks ~6 ms of rank 0's GIL a round."""
        if self._beat_keys is None:
            self._beat_keys = [f"beat/{rank}" for rank in range(self.world_size)]
        return self._beat_keys

    def _check_beats(self, now: float) -> None:
        """Rank 0: mark the ranks whose counter has not moved for the bound, publish those still
        for a gap; a part of the counters a round (BeatJudge.next_part). Every beat key exists
        (_introduce): no check of N keys a round (it doubled the keys rank 0 names a second)."""
        start, end = self._judge.next_part()
        values = batched.multi_get(self._store, self._beats()[start:end])  # see batched
        for rank, age_s in self._judge.still(values, now, start):
            if rank in self._departed:  # it left with a marker of its own
                continue
            host, pid, node = self._who(rank)
            how = f"stopped sending heartbeats {age_s:.0f} s ago (killed, or frozen?)"
            marker = {"host": host, "pid": pid, "how": how, "age_s": age_s, "node": node}
            self.write_marker(rank, marker)
            self.presume_dead([rank])
        listed = self._judge.stale(now, self._listed_s)
        stale = encode_stale([rank for rank in listed if rank not in self._departed])
        if stale != self._stale_published:  # within the round beat/0 counts: see StaleWatch
            self._store.set("stale", stale)
            self._stale_published = stale

    def _read_stale(self) -> None:
        """A hurry's read of rank 0's round counter and stale list, 4 times a round at most, and
        once more when the host leaves (it lists a rank before it names it, then leaves)."""
        now = self._clock()
        with self._lock:
            watch, found_already = self._stale_watch, bool(self._silent)
        soon = now - self._stale_read_at < self._interval_s / 4 and not self.released
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

    def linger(self, deadline_s: float) -> None:
        """The store's host, leaving: announce it, then wait until every other rank that may
        still be alive has done its last store operation, so that none of them hits a vanished
        store (torch logs each such failure with a C++ stack trace). Bounded by ``deadline_s``:
        a rank killed without a marker never answers."""
        if self.failure is not None:
            return
        self._store.set("closing", "1")
        self._store.add("events", 1)  # wakes the pollers' look at "closing"
        deadline = self._clock() + deadline_s
        while self._clock() < deadline:
            with self._lock:
                expected = self.world_size - 1 - len(self._presumed_dead)
            if int(self._store.add("done", 0)) >= expected:
                return
            time.sleep(HOOK_POLL_S)
