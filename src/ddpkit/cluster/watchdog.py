"""The peer watchdog: when a rank exits early, dies or freezes, its peers end within a bound.

Without it, a rank that leaves the job (a bug that skips the loop, a crash, ``kill -9``, a dead
node) is learned of from the backend: gloo fails at once with "Connection closed by peer
[address]" (no rank named), NCCL blocks until the collective timeout (10-30 min). ``init()``
starts a watchdog when it creates a group of several ranks (not when it adopts someone else's);
``shutdown()`` stops it. The bound is ``init(peer_timeout_s=)``, else ``DDPKIT_PEER_TIMEOUT``
(seconds; ``0`` or ``off`` disables it), else 60 s; the watchdog polls every
``min(1 s, bound / 4)``.

It talks over the job's rendezvous store only (its own connection, a ``clone()`` of the default
group's store, keys under ``ddpkit/watchdog/``), never over a collective, from two daemon
threads: ``ddpkit-watchdog-store`` does every store operation, ``ddpkit-watchdog`` judges and
never waits on the store (a store whose host froze blocks an operation for good).

* Exit markers. A rank leaving writes ``exit/<rank>`` (host, pid, how: "exited", "raised
  ValueError: ...", "left the job (ddpkit.shutdown())"), appends its rank to ``order`` and bumps
  ``events``: at exit (an atexit handler that runs before ddpkit's own one destroys the group,
  since destroying it is what wakes the peers), in ``shutdown()``, and from a chained
  ``sys.excepthook`` for an uncaught exception.
* Heartbeats. Every rank bumps ``beat/<rank>`` each interval; rank 0 alone reads them all (one
  ``multi_get``) and writes the marker of a rank whose counter has not moved for the bound
  ("stopped sending heartbeats N s ago"): ``kill -9``, a frozen process, a dead node. Time is
  each process's monotonic clock, so clocks need not agree. A store that stops answering means
  its host is gone: rank 0 (``tcp://``, ``env://`` outside torchrun) or the launcher's agent.
  Per interval each rank costs the store two operations (a beat and one ``events`` poll) and
  rank 0 one more of world-size keys. Rank 0, when it hosts the store, waits at its own exit
  (a few seconds at most) until the other ranks have done their last store operation, so that
  none of them hits a vanished store (torch logs that with a C++ stack trace).
* Survivors. A peer's marker alone ends nobody: at the end of a run ranks leave at slightly
  different times, and rank 0 may work on alone. A rank is ended only when, after a peer left,
  the thread that called ``init()`` (the main thread, usually) has been *blocked* for the whole
  bound: the same innermost frame at the same instruction at every sample and, on Linux, no
  voluntary context switch of that thread (a loop of short sleeps or waits keeps switching; a
  thread blocked in a collective or a device sync does not; elsewhere only the frame counts).
  It then prints where it was blocked and one line naming the peer, e.g.
  ``ddpkit: rank 1 on host nodeB (pid 4242) exited while rank 0 was waiting for it in a
  collective; ending rank 0 after 5.0 s (bound: DDPKIT_PEER_TIMEOUT=5)``, terminates its own
  child processes (data loader workers) and exits with code 1.
* With gloo a survivor usually fails at once ("Connection closed by peer"). The excepthook then
  waits briefly for the marker of the rank that left first (none when it was killed: then for
  two heartbeat snapshots, to find the rank whose beats stopped; 2-2.5 s, twice that at most on
  a slow machine), and prints the same kind of line after the traceback, where launchers look
  for the cause.

False positives: a rank whose training thread sits in ONE long call (a C call, a single long
``time.sleep``, a long operation holding the GIL) for longer than the bound after a peer has
left looks exactly like a blocked rank and is ended. Raise the bound, or call
``ddpkit.shutdown()`` before such solo work: after it the watchdog is stopped. A rank whose
threads cannot run for the bound (the GIL held that long) is reported by rank 0 as silent.
A rank that hangs while alive and keeps sending heartbeats is bounded by the collective timeout
(``init(timeout_s=)`` or ``DDPKIT_COLLECTIVE_TIMEOUT``), not by this module.

This module imports torch only when a watchdog starts.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import queue
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, cast

from ddpkit.cluster.durations import positive_seconds, seconds_from_env

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

__all__ = [
    "DEFAULT_PEER_TIMEOUT_S",
    "PEER_TIMEOUT_VAR",
    "THREAD_NAME",
    "Departure",
    "Watchdog",
    "abort_message",
    "active",
    "interval_for",
    "peer_timeout",
    "pick_cause",
    "raised_message",
    "start",
]

PEER_TIMEOUT_VAR = "DDPKIT_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT_S = 60.0
THREAD_NAME = "ddpkit-watchdog"
STORE_THREAD_NAME = "ddpkit-watchdog-store"
KEY_PREFIX = "ddpkit/watchdog/"
ABORT_EXIT_CODE = 1
_HOOK_POLL_S = 0.05
_SAY_TIMEOUT_S = 2.0  # how long a leaving rank waits for its marker to be written
# In the RuntimeErrors a collective raises when a peer is gone (NCCL's are DistErrors).
_PEER_FAILURE_TEXTS = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl")


# --- configuration (pure) -----------------------------------------------------------------------


def peer_timeout(env: Mapping[str, str], explicit_s: float | None) -> float | None:
    """The watchdog's bound in seconds, or None when it is off.

    ``explicit_s`` (``init(peer_timeout_s=)``) wins; else ``DDPKIT_PEER_TIMEOUT`` from ``env``;
    else 60 s. ``0`` (or ``off`` in the variable) turns the watchdog off.
    """
    if explicit_s is not None:
        if explicit_s == 0 and not isinstance(explicit_s, bool):
            return None
        hint = "e.g. peer_timeout_s=120, or 0 for off"
        return positive_seconds(explicit_s, "peer_timeout_s", hint=hint)
    if _is_off(env.get(PEER_TIMEOUT_VAR, "").strip().lower()):
        return None
    hint = f"e.g. {PEER_TIMEOUT_VAR}=120, or {PEER_TIMEOUT_VAR}=off to turn the watchdog off"
    value = seconds_from_env(env, PEER_TIMEOUT_VAR, example="120", hint=hint)
    return DEFAULT_PEER_TIMEOUT_S if value is None else value


def _is_off(raw: str) -> bool:
    """``off``, or a number equal to 0 (``0``, ``0.0``)."""
    try:
        return raw == "off" or float(raw) == 0
    except ValueError:
        return False


def interval_for(bound_s: float) -> float:
    """How often the watchdog polls and samples: ``min(1 s, bound / 4)``."""
    return min(1.0, bound_s / 4)


def _hook_wait_for(interval_s: float) -> float:
    """How long an uncaught peer failure waits for the culprit's marker (>= 2 heartbeats)."""
    return min(2.5, max(2.0, 2.5 * interval_s))


# --- who left, and what to say (pure) -----------------------------------------------------------


@dataclass(frozen=True)
class Departure:
    """A rank (or the store's host) that left. ``victim``: it left because another one did."""

    rank: int | None  # None: the launcher's store, which no rank hosts
    who: str  # "rank 1 on host nodeB (pid 4242)"
    how: str  # "exited", "raised ValueError: bad batch", "stopped sending heartbeats 61 s ago"
    victim: bool = False
    left_at: float = 0.0  # this process's monotonic clock

    def subject(self) -> str:
        return f"{self.who} {self.how}"


def describe_rank(rank: int, host: str | None, pid: int | None) -> str:
    """``rank 1 on host nodeB (pid 4242)``; the unknown parts are left out."""
    text = f"rank {rank}"
    if host:
        text += f" on host {host}"
    if pid is not None:
        text += f" (pid {pid})"
    return text


def pick_cause(departures: Sequence[Departure], me: int) -> Departure | None:
    """The departure to name: the first other rank that left on its own, else the first one."""
    others = [d for d in departures if d.rank != me]
    for departure in others:
        if not departure.victim:
            return departure
    return others[0] if others else None


def _whose_log(cause: Departure) -> str:
    return "the launcher's" if cause.rank is None else f"rank {cause.rank}'s"


def abort_message(cause: Departure, me: int, waited_s: float, bound_s: float) -> str:
    """The line a blocked survivor prints before the watchdog ends it."""
    return (
        f"ddpkit: {cause.subject()} while rank {me} was waiting for it in a collective; "
        f"ending rank {me} after {waited_s:.1f} s (bound: {PEER_TIMEOUT_VAR}={bound_s:g}) "
        f"(hint: start with {_whose_log(cause)} log; if rank {me} was only busy in one long "
        f"call after its peers had finished, raise {PEER_TIMEOUT_VAR} or call "
        "ddpkit.shutdown() before such solo work)"
    )


def raised_message(cause: Departure | None, me: int, error: str, waited_s: float) -> str:
    """The line the excepthook prints after the traceback of a failed collective."""
    if cause is None:
        return (
            f"ddpkit: rank {me} lost a peer in a collective ({error} above), but no rank "
            f"reported leaving within {waited_s:.1f} s (hint: look for the rank that failed "
            "first in the other ranks' logs or the launcher's report)"
        )
    return (
        f"ddpkit: {cause.subject()} while rank {me} was waiting for it in a collective; "
        f"rank {me} fails with the {error} above (hint: start with {_whose_log(cause)} log: "
        "every rank must reach the same collectives)"
    )


def looks_like_peer_failure(error: BaseException) -> bool:
    """Whether an exception is what a collective raises when a peer is gone."""
    if any(kind.__name__ == "DistError" for kind in type(error).__mro__):  # torch.distributed's
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(t in text for t in _PEER_FAILURE_TEXTS)


def _how_it_raised(kind: type[BaseException], error: BaseException) -> str:
    if issubclass(kind, KeyboardInterrupt):
        return "was interrupted (KeyboardInterrupt)"
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if len(first) > 160:
        first = first[:157] + "..."
    return f"raised {kind.__name__}: {first}" if first else f"raised {kind.__name__}"


# --- the training thread: blocked or not ---------------------------------------------------------

_SWITCHES = re.compile(rb"^voluntary_ctxt_switches:\s*(\d+)", re.MULTILINE)


def _voluntary_switches(native_id: int | None) -> int | None:
    """How often thread ``native_id`` of this process went to sleep (Linux), else None."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/status", "rb") as status:
            match = _SWITCHES.search(status.read())
    except OSError:
        return None
    return int(match.group(1)) if match else None


class _Progress:
    """Samples a thread; ``blocked_since`` is when its signature last changed.

    The signature: innermost frame (id), code, instruction offset, and on Linux the thread's
    voluntary context switches. No reference to the frame is kept (its locals may be large).
    """

    def __init__(self, thread: threading.Thread, clock: Callable[[], float]) -> None:
        self._thread = thread
        self._last: tuple[int, int, int, int | None] | None = None
        self.blocked_since = clock()

    def sample(self, now: float) -> None:
        signature = self._signature()
        if signature is None or signature != self._last:
            self.blocked_since = now
        self._last = signature

    def _signature(self) -> tuple[int, int, int, int | None] | None:
        thread = self._thread
        if thread.ident is None or not thread.is_alive():  # the program's main code is done
            return None
        frame = sys._current_frames().get(thread.ident)
        if frame is None:
            return None
        signature = (id(frame), id(frame.f_code), frame.f_lasti)
        del frame
        return (*signature, _voluntary_switches(thread.native_id))


# --- the store side -----------------------------------------------------------------------------


class _KeyValue(Protocol):
    """The store operations the watchdog uses: none of them waits for a key to appear."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...  # only of keys known to exist
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def append(self, key: str, value: str) -> None: ...


@dataclass
class _Request:
    work: Callable[[], None]
    done: threading.Event


class _Link:
    """The one thread that talks to the store; what it learns is read under ``_lock``."""

    def __init__(
        self,
        store: _KeyValue,
        *,
        rank: int,
        world_size: int,
        interval_s: float,
        bound_s: float,
        host_rank: int | None,
        address: str,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self.rank, self.world_size = rank, world_size
        self._interval_s, self._bound_s = interval_s, bound_s
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
        self._hurry_until = 0.0
        self._snapshot_first: tuple[float, list[int]] | None = None
        self._silent: list[Departure] | None = None
        self._beats: dict[int, tuple[int, float]] = {}
        self._presumed_dead: set[int] = set()  # ranks rank 0 wrote a heartbeat marker for
        self._thread = threading.Thread(target=self._run, name=STORE_THREAD_NAME, daemon=True)

    # called from other threads

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait_s: float = 1.0) -> None:
        """End the thread after its last store operation (waits up to ``wait_s`` for it)."""
        self._stopping.set()
        self._wake.set()
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
        """Poll at 20 Hz for a while and take the beat snapshots :meth:`silent` compares."""
        with self._lock:
            self._snapshot_first, self._silent = None, None
        self._hurry_until = self._clock() + duration_s
        self._wake.set()

    def silent(self) -> list[Departure] | None:
        """Ranks with no marker whose beats did not move across the two snapshots a hurry
        takes, >= 2 intervals apart (None until the second one)."""
        with self._lock:
            return None if self._silent is None else list(self._silent)

    # the thread

    def _run(self) -> None:
        try:
            self._introduce()
            next_beat = 0.0
            while True:
                self._serve()
                if self._stopping.is_set() or self.released:
                    break
                now = self._clock()
                if now >= next_beat:
                    self._store.add(f"beat/{self.rank}", 1)
                    if self.rank == 0:
                        self._check_beats(now)
                    next_beat = now + self._interval_s
                self._poll()
                hurrying = self._clock() < self._hurry_until
                if hurrying:
                    self._snapshot()
                with self._lock:
                    self.last_ok = self._clock()
                wait_s = _HOOK_POLL_S if hurrying else max(0.0, next_beat - self._clock())
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
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        self._store.set(f"who/{self.rank}", me)
        if self.rank == 0:  # every beat key exists from now on: multi_get never blocks
            for rank in range(self.world_size):
                self._store.add(f"beat/{rank}", 0)

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

    def _read_marker(self, rank: int, now: float) -> Departure:
        raw = self._store.get(f"exit/{rank}")
        try:
            marker = json.loads(raw.decode())
            age_s = float(marker.get("age_s", 0.0))
            pid = marker.get("pid")
            return Departure(
                rank,
                describe_rank(rank, str(marker.get("host") or ""), pid),
                str(marker.get("how") or "left"),
                victim=bool(marker.get("victim", False)),
                left_at=now - age_s,
            )
        except (ValueError, TypeError, AttributeError):
            return Departure(rank, describe_rank(rank, None, None), "left", left_at=now)

    def _who(self, rank: int) -> tuple[str | None, int | None]:
        key = f"who/{rank}"
        if not self._store.check([key]):
            return None, None
        try:
            who = json.loads(self._store.get(key).decode())
            return str(who["host"]), int(who["pid"])
        except (ValueError, TypeError, KeyError):
            return None, None

    def _beat_values(self) -> list[int] | None:
        keys = [f"beat/{rank}" for rank in range(self.world_size)]
        if not self._store.check(keys):
            return None
        return [int(value) for value in self._store.multi_get(keys)]

    def _check_beats(self, now: float) -> None:
        """Rank 0: mark the ranks whose beat counter has not moved for the bound."""
        values = self._beat_values()
        if values is None:
            return
        for rank, value in enumerate(values):
            if rank == self.rank or rank in self._departed:
                continue
            last = self._beats.get(rank)
            if last is None or last[0] != value:
                self._beats[rank] = (value, now)
                continue
            age_s = now - last[1]
            if age_s >= self._bound_s:
                host, pid = self._who(rank)
                how = f"stopped sending heartbeats {age_s:.0f} s ago (killed, or frozen?)"
                marker = {"host": host, "pid": pid, "how": how, "age_s": age_s}
                self.write_marker(rank, marker)
                self.presume_dead([rank])

    def _snapshot(self) -> None:
        with self._lock:
            first = self._snapshot_first
        now = self._clock()
        if first is not None and (
            self._silent is not None or now - first[0] < 2.2 * self._interval_s
        ):
            return
        values = self._beat_values()
        if values is None:
            return
        if first is None:
            with self._lock:
                self._snapshot_first = (now, values)
            return
        found = []
        for rank, (before, after) in enumerate(zip(first[1], values, strict=True)):
            if rank != self.rank and rank not in self._departed and before == after:
                host, pid = self._who(rank)
                how = "stopped sending heartbeats (killed?)"
                found.append(Departure(rank, describe_rank(rank, host, pid), how, left_at=first[0]))
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
            time.sleep(_HOOK_POLL_S)


# --- the watchdog -------------------------------------------------------------------------------


class Watchdog:
    """One rank's watchdog; :func:`start` makes it, ``stop`` ends it (writing the exit marker)."""

    def __init__(self, link: _Link, *, bound_s: float, clock: Callable[[], float]) -> None:
        self._link = link
        self.rank, self.world_size = link.rank, link.world_size
        self.bound_s, self.interval_s = bound_s, interval_for(bound_s)
        self._clock = clock
        self._pid = os.getpid()
        self._main = threading.current_thread()  # the thread that joined: it runs collectives
        self._stop = threading.Event()
        self._said = False
        self._stopped = False
        self._handled: int | None = None
        self._judge = threading.Thread(target=self._watch, name=THREAD_NAME, daemon=True)

    @property
    def owned(self) -> bool:
        """False in a forked child (a data loader worker): it must not touch the parent's link."""
        return os.getpid() == self._pid

    def start(self) -> None:
        self._link.start()
        self._judge.start()

    def stop(self, how: str = "exited") -> None:
        """Say that this rank leaves (unless said already), then stop both threads. Idempotent."""
        if self._stopped or not self.owned:
            return
        self._stopped = True
        self._stop.set()
        self._say(how)
        self._linger()
        self._link.stop()

    # the judge thread

    def _watch(self) -> None:
        progress = _Progress(self._main, self._clock)
        while not self._stop.wait(self.interval_s):
            try:
                now = self._clock()
                progress.sample(now)
                cause = self._cause(now)
                if cause is None:
                    continue
                blocked_s = now - max(progress.blocked_since, cause.left_at)
                if blocked_s >= self.bound_s and not self._stop.is_set():
                    self._abort(cause, blocked_s)
            except Exception:  # never into the program; try again next interval
                continue

    def _cause(self, now: float) -> Departure | None:
        departures = self._link.departures()
        store = self._link.store_departure(now)
        return pick_cause([*departures, *([store] if store else [])], self.rank)

    def _abort(self, cause: Departure, blocked_s: float) -> None:
        """Say where this rank is blocked and who left, leave a marker, reap, exit."""
        frame = sys._current_frames().get(self._main.ident or -1)
        lines = []
        if frame is not None:
            lines += [
                f"ddpkit: rank {self.rank} is blocked here:",
                "Traceback (most recent call last):",
                "".join(traceback.format_stack(frame)).rstrip("\n"),
            ]
            del frame
        lines.append(abort_message(cause, self.rank, blocked_s, self.bound_s))
        _write_stderr("\n".join(lines) + "\n")
        self._stopped = True
        if self._link.store_departure(self._clock()) is None:  # else a store call may hang
            self._say("was ended by the ddpkit watchdog", victim=True)
            self._linger()
            self._link.stop()
        _reap_children()
        os._exit(ABORT_EXIT_CODE)

    # leaving

    def _say(self, how: str, *, victim: bool = False) -> None:
        """Write this rank's exit marker, once."""
        if self._said:
            return
        self._said = True
        marker = {"host": socket.gethostname(), "pid": os.getpid(), "how": how, "victim": victim}
        link = self._link
        link.call(lambda: link.write_marker(self.rank, marker), _SAY_TIMEOUT_S)

    def _linger(self) -> None:
        """The store's host, leaving: give its peers time to read its marker and let go."""
        link = self._link
        if link.host_rank == self.rank:
            linger_s = max(2.0, 3 * self.interval_s)
            link.call(lambda: link.linger(linger_s), linger_s + 1.0)

    def on_uncaught(self, kind: type[BaseException], error: BaseException) -> bool:
        """Excepthook, before the traceback: write this rank's marker. True when the error
        looks like a failed collective: then :meth:`name_culprit` after the traceback."""
        if self._stopped or not self.owned or self._handled == id(error):
            return False
        self._handled = id(error)
        victim = looks_like_peer_failure(error)
        self._say(_how_it_raised(kind, error), victim=victim)
        return victim

    def name_culprit(self, kind: type[BaseException]) -> str:
        """The line naming the rank that left first (waits for its marker, briefly)."""
        waited_s = _hook_wait_for(self.interval_s)
        cause = self._wait_for_cause(waited_s)
        return raised_message(cause, self.rank, kind.__name__, waited_s)

    def _wait_for_cause(self, wait_s: float) -> Departure | None:
        """Up to ``wait_s`` for a rank that left on its own, else one whose heartbeats
        stopped; twice as long at most while a slow store thread still owes its comparison."""
        started = self._clock()
        self._link.hurry(2 * wait_s)
        while True:
            now = self._clock()
            cause = self._cause(now)
            if cause is not None and not cause.victim:
                return cause
            silent = self._link.silent()
            if silent:
                self._link.presume_dead(departure.rank for departure in silent)
                return silent[0]
            late = silent is None and self._link.alive() and now - started < 2 * wait_s
            if now - started >= wait_s and not late:
                return cause
            time.sleep(_HOOK_POLL_S)


def _write_stderr(text: str) -> None:
    with contextlib.suppress(Exception):
        if sys.stderr is not None:
            sys.stderr.write(text)
            sys.stderr.flush()


def _reap_children(grace_s: float = 1.0) -> None:
    """Terminate this process's multiprocessing children (data loader workers), then kill."""
    try:
        children = multiprocessing.active_children()
        for child in children:
            child.terminate()
        deadline = time.monotonic() + grace_s
        for child in children:
            child.join(max(0.0, deadline - time.monotonic()))
        for child in children:
            if child.is_alive():
                child.kill()
                child.join(grace_s)
    except Exception:
        pass


# --- process-wide wiring ------------------------------------------------------------------------

_Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


@dataclass
class _Process:
    active: Watchdog | None = None
    generation: int = 0  # watchdogs started by this process: a fresh key namespace each
    previous_hook: _Hook | None = None
    atexit_registered: bool = False


_PROCESS = _Process()


def active() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _PROCESS.active


def _excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    """Chained ``sys.excepthook``: the marker, the usual traceback, then the culprit's name
    (last, where launchers such as ``ddpkit run`` look for the cause)."""
    watchdog, culprit = _PROCESS.active, False
    if watchdog is not None:
        try:
            culprit = watchdog.on_uncaught(kind, error)
        except Exception:
            culprit = False
    (_PROCESS.previous_hook or sys.__excepthook__)(kind, error, tb)
    if culprit and watchdog is not None:
        with contextlib.suppress(Exception):
            _write_stderr(watchdog.name_culprit(kind) + "\n")


def _at_exit() -> None:
    """Registered after ddpkit's group destroyer, so it runs first: the marker precedes the
    closing of the group's sockets, which is what wakes the peers."""
    watchdog = _PROCESS.active
    if watchdog is not None:
        watchdog.stop("exited")


def _wire_process() -> None:
    """Chain the excepthook (again if someone replaced it, e.g. torch's init_process_group)
    and register the atexit handler, once."""
    if sys.excepthook is not _excepthook:
        _PROCESS.previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    if not _PROCESS.atexit_registered:
        atexit.register(_at_exit)
        _PROCESS.atexit_registered = True


def _store_address(store: Store) -> str:
    inner: Any = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if host is None or port is None:
        return type(inner).__name__
    return f"{host}:{port}"


def start(
    *,
    rank: int,
    world_size: int,
    bound_s: float,
    store: Store | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Watchdog:
    """Start this rank's watchdog on the default group's store (or ``store``).

    Rank 0 hosts the store unless the workers use torchrun's agent store (torch decides that
    from ``TORCHELASTIC_USE_AGENT_STORE`` in ``os.environ``, so this reads it there too). Stops
    a watchdog this process still runs.
    """
    from torch.distributed.distributed_c10d import PrefixStore, _get_default_store

    stop("left the job")
    base = store if store is not None else _get_default_store()
    own = base
    clone = getattr(base, "clone", None)  # torch >= 2.4 for TCPStore
    if clone is not None:
        try:
            own = clone()  # its own connection: never queued behind the program's store calls
            own.set_timeout(timedelta(seconds=max(10.0, 4 * interval_for(bound_s))))
        except RuntimeError:
            own = base
    missing = [name for name in ("append", "multi_get", "check") if not hasattr(own, name)]
    if missing:
        raise RuntimeError(f"the store ({type(own).__name__}) lacks {', '.join(missing)}")
    host_rank = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) else 0
    # Restarts of a torchrun job may share one store; so may several init()s of one process.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _PROCESS.generation += 1
    prefix = f"{KEY_PREFIX}{attempt}/{_PROCESS.generation}/"
    link = _Link(
        cast(_KeyValue, PrefixStore(prefix, own)),
        rank=rank,
        world_size=world_size,
        interval_s=interval_for(bound_s),
        bound_s=bound_s,
        host_rank=host_rank,
        address=_store_address(base),
        clock=clock,
    )
    watchdog = Watchdog(link, bound_s=bound_s, clock=clock)
    _wire_process()
    watchdog.start()
    _PROCESS.active = watchdog
    return watchdog


def stop(how: str = "exited") -> None:
    """Stop this process's watchdog, if one runs (its exit marker says ``how``)."""
    watchdog, _PROCESS.active = _PROCESS.active, None
    if watchdog is not None:
        watchdog.stop(how)
