"""The watchdog's one thread and its process-wide wiring (``start``, ``stop``, ``active``, the
chained ``sys.excepthook``, its exit step). Exit bound (:meth:`Watchdog.stop`): the thread is
waited for ``T`` at most; still inside a store call, its connection is cut and it is waited for
``min(1 s, T)``, no marker written; else the marker takes one store reply: ``2 x T`` in all.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ddpkit.cluster.stop.blamed import record_blame
from ddpkit.contract import HANG_ACTION_VAR
from ddpkit.worker import exit as process_exit
from ddpkit.worker.rendezvous.store import own_connection, store_address
from ddpkit.worker.watchdog import policy
from ddpkit.worker.watchdog.flight import Flight
from ddpkit.worker.watchdog.hang import HangBounds
from ddpkit.worker.watchdog.hangwatch import HangWatch, stacks_off, stacks_on_signal
from ddpkit.worker.watchdog.policy import Departure
from ddpkit.worker.watchdog.store import BeatJudge, StoreLink

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

CUT_WAIT_S = 1.0  # how long the exit waits for the thread once its connection is cut
_SWITCHES = re.compile(rb"^voluntary_ctxt_switches:\s*(\d+)", re.MULTILINE)
_Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


class Progress:
    """``blocked_since``: when a thread's innermost frame, instruction or (Linux) voluntary
    context switches last changed (a loop of short sleeps keeps switching; a wait does not)."""

    def __init__(self, thread: threading.Thread, clock: Callable[[], float]) -> None:
        self._thread = thread
        self._last: tuple[int, int, int, bytes | None] | None = None
        self.blocked_since = clock()

    def sample(self, now: float) -> None:
        signature = self._signature()
        if signature is None or signature != self._last:
            self.blocked_since = now
        self._last = signature

    def _signature(self) -> tuple[int, int, int, bytes | None] | None:
        thread = self._thread
        frame = sys._current_frames().get(thread.ident or -1) if thread.is_alive() else None
        if frame is None:  # the program's main code is done
            return None
        signature = (id(frame), id(frame.f_code), frame.f_lasti)
        del frame
        switches = None
        path = f"/proc/self/task/{thread.native_id}/status"
        with contextlib.suppress(OSError), open(path, "rb") as status:
            found = _SWITCHES.search(status.read())
            switches = found.group(1) if found else None
        return (*signature, switches)


class Watchdog:
    """One rank's watchdog; :func:`start` makes it."""

    def __init__(self, link: StoreLink, bound_s: float) -> None:
        self.link, self.rank, self._clock = link, link.rank, link.clock
        self.bound_s, self.interval_s = bound_s, policy.interval_for(bound_s)
        self._pid = os.getpid()
        self._main = threading.current_thread()  # the thread that joined: it runs collectives
        self._stop = threading.Event()
        self._said = self._stopped = False
        self._handled: int | None = None
        self.hangs: HangWatch | None = None  # the hang watchdog, when on
        self.stragglers: Callable[[float], None] | None = None  # ddpkit.worker.straggler's hook
        self._thread = threading.Thread(target=self._watch, name=policy.THREAD_NAME, daemon=True)

    def stop(self, how: str = "exited") -> None:
        """Stop the thread within the exit bound, then write this rank's marker, once: no thread
        of ours may return from torch's C++ code while the interpreter finalizes (an abort)."""
        if self._stopped or os.getpid() != self._pid:  # a forked child: not its link
            return
        self._stopped = True
        link = self.link
        link.stopping = True
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(link.op_timeout_s)
            if self._thread.is_alive():  # inside a store call still: cut it; no marker
                link.cut()
                self._thread.join(min(CUT_WAIT_S, link.op_timeout_s))
                return
        self._say(how)

    def _watch(self) -> None:
        progress = Progress(self._main, self._clock)
        next_judge = self._clock() + self.interval_s
        while not self._stop.is_set():
            now = self._clock()
            next_store = self.link.step(now)
            if now >= next_judge:
                next_judge = now + self.interval_s
                self._judge(progress, now)
            self._stop.wait(max(0.0, min(next_store, next_judge) - self._clock()))

    def _judge(self, progress: Progress, now: float) -> None:
        try:
            progress.sample(now)
            if self.hangs is not None:
                text = self.hangs.check(now)
                if text is not None and not self._stop.is_set():
                    self._act_on_hang(self.hangs, text)
            if self.stragglers is not None:
                self.stragglers(now)
            cause = self._cause()
            if cause is None:
                return
            blocked_s = now - max(progress.blocked_since, cause.left_at)
            # in a collective (or blocked, the hang watchdog off): it cannot complete, a peer left
            blocked = blocked_s >= self.bound_s and not self._stop.is_set()
            if blocked and (self.hangs is None or self.hangs.flight.in_collective()):
                self._abort(cause, blocked_s)
        except Exception:  # never into the program; try again next interval
            return

    def _cause(self) -> Departure | None:
        store = self.link.failure
        return policy.pick_cause([*self.link.departures(), *([store] if store else [])], self.rank)

    def _abort(self, cause: Departure, blocked_s: float) -> None:
        frame = sys._current_frames().get(self._main.ident or -1)
        lines = []
        if frame is not None:
            stack = "".join(traceback.format_stack(frame)).rstrip("\n")
            del frame
            head = f"ddpkit: rank {self.rank} is blocked here:"
            lines += [head, "Traceback (most recent call last):", stack]
        lines.append(policy.abort_message(cause, self.rank, blocked_s, self.bound_s))
        write_stderr("\n".join(lines) + "\n")
        _blame_node(cause)
        self._end("was ended by the ddpkit watchdog")

    def _end(self, how: str) -> None:
        """Leave a marker, reap the children (data loader workers), flush and exit."""
        self._stopped = True
        self._say(how, victim=True)
        with contextlib.suppress(Exception):
            children = multiprocessing.active_children()
            for child in children:
                child.terminate()
            deadline = time.monotonic() + 1.0
            for child in children:
                child.join(max(0.0, deadline - time.monotonic()))
                if child.is_alive():
                    child.kill()
        process_exit.hard_exit(policy.ABORT_EXIT_CODE)

    def _act_on_hang(self, hangs: HangWatch, text: str) -> None:
        """Every rank keeps the report in its log folders; rank 0 prints it (or the gatherer,
        when rank 0 sent nothing). ``report`` (the default) lets the job go on, with no other
        report this run; ``end`` has the others print one line, and every rank exit."""
        end = hangs.bounds.end
        hangs.done = True
        paths = hangs.write(text)
        also = f" and in {' and '.join(paths)}" if paths else ""
        if self.rank == 0 or hangs.without_rank0:
            where = f"\nddpkit: this report is also{also[4:]}" if paths else ""
            goes_on = (
                f"\nddpkit: the job goes on ({HANG_ACTION_VAR}=report): a rank may be slow, "
                "not stuck; torch's collective timeout ends it if it never resumes, "
                f"{HANG_ACTION_VAR}=end ends it at the report"
            )
            write_stderr(f"{text}{where}{'' if end else goes_on}\n")
        elif end:
            write_stderr(
                f"ddpkit: rank {self.rank} ends: the hang watchdog's report is on rank 0's "
                f"stderr{also}; its first line: {text.splitlines()[0]}\n"
            )
        if end:
            self.link.host_waits("hang/read", self.link.world_size - 1, hangs.gather_s())
            self._end("was ended by the ddpkit hang watchdog")

    def _say(self, how: str, *, victim: bool = False) -> None:
        if not self._said:
            self._said = True
            host, pid = socket.gethostname(), os.getpid()
            self.link.leave({"host": host, "pid": pid, "how": how, "victim": victim})

    def on_uncaught(self, kind: type[BaseException], error: BaseException) -> bool:
        """Before the traceback: write this rank's marker; whether the error looks like a
        failed collective (then :meth:`name_culprit` after the traceback)."""
        if self._stopped or os.getpid() != self._pid or self._handled == id(error):
            return False
        self._handled = id(error)
        victim = policy.looks_like_peer_failure(error)
        self._say(policy.how_it_raised(kind, error), victim=victim)
        return victim

    def name_culprit(self, kind: type[BaseException]) -> str:
        """The line naming the rank that left first: waits for its marker, or (a rank killed
        writes none) for a counter that stood still for :data:`STALE_BEATS` beat intervals."""
        wait_s = min(2.5, max(2.0, 2.5 * self.interval_s))  # >= 2 heartbeats
        gap_s = policy.STALE_BEATS * self.link.beat_interval_s
        deadline = self._clock() + (2 * wait_s if gap_s <= 2 * wait_s else wait_s)
        judge = BeatJudge(self.rank, gap_s)
        cause = self._cause()
        while (cause is None or cause.victim) and self._clock() < deadline:
            time.sleep(self.interval_s / 4)
            cause = self._cause()
            if cause is None or cause.victim:
                cause = self.link.silent(judge, self._clock()) or cause
        _blame_node(cause)
        self.link.named(cause, wait_s)
        return policy.raised_message(cause, self.rank, kind.__name__, wait_s)


def _blame_node(cause: Departure | None) -> None:
    """A rank whose heartbeats stopped blames its node for the bad-node exclusion."""
    if cause is not None and cause.node and "stopped sending heartbeats" in cause.how:
        record_blame(os.environ, cause.node, f"rank {cause.rank} {cause.how}")


def write_stderr(text: str) -> None:
    with contextlib.suppress(Exception):
        if sys.stderr is not None:
            sys.stderr.write(text)
            sys.stderr.flush()


@dataclass
class _Process:
    active: Watchdog | None = None
    generation: int = 0  # watchdogs started by this process: a fresh key namespace each
    previous_hook: _Hook | None = None


_PROCESS = _Process()


def active() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _PROCESS.active


def _excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    """The marker, the usual traceback, then the culprit's name (last, where launchers look)."""
    watchdog, culprit = _PROCESS.active, False
    hangs = watchdog.hangs if watchdog is not None else None
    if watchdog and hangs and hangs.bounds.end and (hangs.done or watchdog.link.hang_asked):
        # a report that ends the job: the watchdog's thread ends this process; wait, bounded
        time.sleep(hangs.gather_s() + 4 * watchdog.interval_s + 5.0)
    if watchdog is not None:
        with contextlib.suppress(Exception):
            culprit = watchdog.on_uncaught(kind, error)
    (_PROCESS.previous_hook or sys.__excepthook__)(kind, error, tb)
    if culprit and watchdog is not None:
        with contextlib.suppress(Exception):
            write_stderr(watchdog.name_culprit(kind) + "\n")


def start(
    *,
    rank: int,
    world_size: int,
    bound_s: float,
    store: Store | None = None,
    hangs: HangBounds | None = None,
) -> Watchdog:
    """Start this rank's watchdog on the default group's store (or ``store``), stopping one
    still running. Rank 0 hosts the store unless the workers use torchrun's agent store."""
    from ddpkit.compat import default_store

    stop("left the job")
    base = store if store is not None else default_store()
    op_timeout_s = policy.op_timeout_for(bound_s)
    # Restarts of a torchrun job may share one store; so may several init()s of one process.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _PROCESS.generation += 1
    own = own_connection(base, f"{policy.KEY_PREFIX}{attempt}/{_PROCESS.generation}/", op_timeout_s)
    if own is None:  # no bounded operations, no exit bound: no watchdog (init() warns)
        raise RuntimeError(
            f"no connection of its own to the job's store at {store_address(base)} within "
            f"{op_timeout_s:g} s"
        )
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    link = StoreLink(
        own.store,
        rank=rank,
        world_size=world_size,
        interval_s=policy.interval_for(bound_s),
        bound_s=bound_s,
        host_rank=None if agent else 0,
        address=store_address(base),
        op_timeout_s=op_timeout_s,
        beat_interval_s=policy.beat_interval_for(bound_s, world_size),
        cut=own.cut,
        closed=own.closed,
    )
    watchdog = Watchdog(link, bound_s)
    if hangs is not None:
        watchdog.hangs = HangWatch(link, Flight(), hangs)
        stacks_on_signal()
    if sys.excepthook is not _excepthook:  # again if someone replaced it (torch's init)
        _PROCESS.previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    process_exit.add(process_exit.MARKER, "the peer watchdog's exit marker", stop)
    watchdog._thread.start()
    _PROCESS.active = watchdog
    return watchdog


def stop(how: str = "exited") -> None:
    """Stop this process's watchdog, if one runs (its exit marker says ``how``): the exit
    path's first step, before the group's sockets close (which wakes the peers)."""
    watchdog, _PROCESS.active = _PROCESS.active, None
    if watchdog is not None:
        stacks_off()
        watchdog.stop(how)
