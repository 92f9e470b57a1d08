"""The watchdog's one thread: beats, judges departures against the bound, ends a blocked survivor.

Each time it wakes it does the store work due (:meth:`StoreLink.step`: a beat, rank 0's round,
a poll of ``events``) and, every interval, samples the training thread and judges; ending a
rank prints where it was blocked and names the peer, reaps this rank's child processes (data
loader workers), flushes stdout and stderr and exits with :data:`ABORT_EXIT_CODE`.

Its exit bound (:meth:`Watchdog.stop`, at exit and in ``shutdown()``): with ``T`` the store
operation's timeout (:func:`~ddpkit.worker.watchdog.policy.op_timeout_for`: ``min(10 s,
bound / 2)``), the thread is stopped and waited for at most ``T`` (a store operation in flight),
then its connection is cut if it is still inside one (the call returns at once) and waited
for again, briefly; the marker then takes one more store reply at most, ``T``: ``2 x T`` in
all, within the bound. A store that answers (the usual case) costs a few milliseconds.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

from ddpkit.cluster.stop.blamed import record_blame
from ddpkit.contract import HANG_ACTION_VAR
from ddpkit.worker import exit as process_exit
from ddpkit.worker.watchdog.hangwatch import HangWatch
from ddpkit.worker.watchdog.liveness import Progress
from ddpkit.worker.watchdog.policy import (
    ABORT_EXIT_CODE,
    HOOK_POLL_S,
    THREAD_NAME,
    Departure,
    abort_message,
    hook_wait_for,
    how_it_raised,
    interval_for,
    looks_like_peer_failure,
    on_grid,
    pick_cause,
    raised_message,
)
from ddpkit.worker.watchdog.store import StoreLink
from ddpkit.worker.watchdog.straggler import StragglerWatch

CUT_WAIT_S = 1.0  # how long the exit waits for the thread once its connection is cut


class Watchdog:
    """One rank's watchdog; :func:`start` makes it, ``stop`` ends it (writing the exit marker)."""

    def __init__(self, link: StoreLink, *, bound_s: float, clock: Callable[[], float]) -> None:
        self._link = link
        self.rank, self.world_size = link.rank, link.world_size
        self.bound_s, self.interval_s = bound_s, interval_for(bound_s)
        self._clock = clock
        self._pid = os.getpid()
        self._main = threading.current_thread()  # the thread that joined: it runs collectives
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._said = False
        self._stopped = False
        self._handled: int | None = None
        self.hangs: HangWatch | None = None  # the hang watchdog, when on
        self.stragglers: StragglerWatch | None = None  # the straggler report, when on
        self.ending = False  # a hang report is out: this rank ends, quietly
        self._thread = threading.Thread(target=self._watch, name=THREAD_NAME, daemon=True)

    @property
    def owned(self) -> bool:
        """False in a forked child (a data loader worker): it must not touch the parent's link."""
        return os.getpid() == self._pid

    def start(self) -> None:
        self._thread.start()

    def stop(self, how: str = "exited") -> None:
        """Stop the thread (see the module's exit bound), then say that this rank leaves
        (unless said already). Idempotent. No thread of the watchdog's is left inside a store
        call: one that returned from torch's C++ code while the interpreter finalizes would
        abort the process (``terminate called without an active exception``)."""
        if self._stopped or not self.owned:
            return
        self._stopped = True
        link = self._link
        link.stopping = True
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(link.op_timeout_s)
            if self._thread.is_alive():  # inside a store call still: end it now
                link.cut()
                self._thread.join(CUT_WAIT_S)
        if not self._thread.is_alive():
            self._say(how)

    # the thread

    def _watch(self) -> None:
        progress = Progress(self._main, self._clock)
        link = self._link
        next_judge = self._clock() + self.interval_s
        while not self._stop.is_set():
            now = self._clock()
            next_store = link.step(now)
            if now >= next_judge:
                next_judge = on_grid(next_judge, self.interval_s, now)
                self._judge(progress, now)
            self._wake.wait(max(0.0, min(next_store, next_judge) - self._clock()))
            self._wake.clear()

    def _judge(self, progress: Progress, now: float) -> None:
        try:
            progress.sample(now)
            text = self.hangs.check(now) if self.hangs is not None else None
            if text is not None and not self._stop.is_set():
                self._act_on_hang(text)
            line = self.stragglers.check(now) if self.stragglers is not None else None
            if line is not None:
                write_stderr(line + "\n")
            cause = self._cause(now)
            if cause is None:
                return
            blocked_s = now - max(progress.blocked_since, cause.left_at)
            if blocked_s >= self.bound_s and self._waits() and not self._stop.is_set():
                self._abort(cause, blocked_s)
        except Exception:  # never into the program; try again next interval
            return

    def _waits(self) -> bool:
        """Whether the blocked rank waits in a collective (DDP's inside ``backward()`` too),
        which cannot end once a peer has left: one is in flight in torch's flight recorder,
        which the hang watchdog reads (by default); a rank blocked anywhere else (one long call
        of its own: a sleep, a C function) is left alone then. Without it, blocked is taken
        as waiting."""
        return self.hangs is None or self.hangs.flight.in_collective()

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
        write_stderr("\n".join(lines) + "\n")
        _blame_node(cause)
        self._stopped = True
        self._say("was ended by the ddpkit watchdog", victim=True)  # none once the store is gone
        _reap_children()
        process_exit.hard_exit(ABORT_EXIT_CODE)

    def _act_on_hang(self, text: str) -> None:
        """Every rank keeps the report in its log folders and rank 0 prints it (or the rank
        that gathered it, rank 0 silent). Then, by ``DDPKIT_HANG_ACTION``: ``report`` (the
        default) lets the job go on, no other report this run; ``end`` has the other ranks
        print one line pointing to it, and every rank leave and exit."""
        hangs = self.hangs
        if hangs is None:
            return
        end = hangs.bounds.end
        self.ending = end
        hangs.done = True
        paths = hangs.write(text)
        if self.rank == 0 or hangs.without_rank0:
            where = f"\nddpkit: this report is also in {' and '.join(paths)}" if paths else ""
            goes_on = (
                f"\nddpkit: the job goes on ({HANG_ACTION_VAR}=report): a rank may be slow, "
                "not stuck; torch's collective timeout ends it if it never resumes, "
                f"{HANG_ACTION_VAR}=end ends it at the report"
            )
            write_stderr(f"{text}{where}{'' if end else goes_on}\n")
        elif end:
            also = f" and in {' and '.join(paths)}" if paths else ""
            write_stderr(
                f"ddpkit: rank {self.rank} ends: the hang watchdog's report is on rank 0's "
                f"stderr{also}; its first line: {text.splitlines()[0]}\n"
            )
        if not end:
            return
        self._link.report_read(hangs.gather_s())
        self._stopped = True
        self._say("was ended by the ddpkit hang watchdog", victim=True)
        _reap_children()
        process_exit.hard_exit(ABORT_EXIT_CODE)

    def hang_pending(self) -> bool:
        """Whether a hang report that ends the job is being gathered or is out (the main
        thread's collective failing then is the report's doing: it waits for the watchdog to
        end the process)."""
        ends = self.hangs is not None and self.hangs.bounds.end
        return self.ending or (ends and self._link.hang_asked)

    # leaving

    def _say(self, how: str, *, victim: bool = False) -> None:
        """Write this rank's exit marker, once (each operation bounded by the store's timeout;
        none once the store is gone)."""
        if self._said:
            return
        self._said = True
        marker = {"host": socket.gethostname(), "pid": os.getpid(), "how": how, "victim": victim}
        self._link.leave(marker)

    def on_uncaught(self, kind: type[BaseException], error: BaseException) -> bool:
        """Excepthook, before the traceback: write this rank's marker. True when the error
        looks like a failed collective: then :meth:`name_culprit` after the traceback."""
        if self._stopped or not self.owned or self._handled == id(error):
            return False
        self._handled = id(error)
        victim = looks_like_peer_failure(error)
        self._say(how_it_raised(kind, error), victim=victim)
        return victim

    def name_culprit(self, kind: type[BaseException]) -> str:
        """The line naming the rank that left first (waits for its marker, briefly)."""
        waited_s = hook_wait_for(self.interval_s)
        cause = self._wait_for_cause(waited_s)
        _blame_node(cause)
        self._link.named(cause, waited_s)
        return raised_message(cause, self.rank, kind.__name__, waited_s)

    def _wait_for_cause(self, wait_s: float) -> Departure | None:
        """Up to ``wait_s`` for a rank that left on its own, else one whose heartbeats
        stopped (rank 0's list); twice as long at most while that may still come."""
        started = self._clock()
        self._link.hurry(2 * wait_s)
        self._wake.set()  # the hurry starts now
        while True:
            now = self._clock()
            cause = self._cause(now)
            if cause is not None and not cause.victim:
                return cause
            silent = self._link.silent()
            if silent:
                return silent[0]
            late = silent is None and self._link.alive() and now - started < 2 * wait_s
            if now - started >= wait_s and not late:
                return cause
            time.sleep(HOOK_POLL_S)


def _blame_node(cause: Departure | None) -> None:
    """A rank whose heartbeats stopped blames its node for the bad-node exclusion."""
    if cause is not None and cause.node and "stopped sending heartbeats" in cause.how:
        record_blame(os.environ, cause.node, f"rank {cause.rank} {cause.how}")


def write_stderr(text: str) -> None:
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
