"""Bounded waits on calls that may block for good inside torch's C++ code.

torch's store client, made against a listener that accepts and never answers, waits in its
handshake with no timeout (its ping's ``recv``): such a call runs in a daemon thread the caller
waits for within a bound, and gives up on when it runs out (:func:`bounded`, :class:`Call`).
"""

from __future__ import annotations

import _thread
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Call", "CallThread", "Outcome", "bounded", "running"]

# Bounded calls still running (see bounded), and how long the exit waits for them in all.
_PENDING: list[CallThread] = []
_EXIT_WAIT_S = 3.0

T = TypeVar("T")


@dataclass
class Outcome(Generic[T]):
    value: T | None = None
    error: Exception | None = None
    pending: CallThread | None = None  # the call had not returned when the bound ran out


class Call(Generic[T]):
    """``call()`` running in a daemon thread; ``wake`` (shared by several calls, when given) is
    set when it returns or raises.

    A call still running when its caller gives up (:meth:`give_up`) is waited for again at
    exit, a little: a daemon thread that comes back from torch's C++ code while the interpreter
    finalizes aborts the process (SIGABRT, "terminate called without an active exception")
    after the error was printed. One blocked for good on a silent listener does no harm: the
    exit ends it.
    """

    def __init__(self, call: Callable[[], T], name: str, wake: threading.Event | None = None):
        self.wake = wake or threading.Event()
        self._box: list[Outcome[T]] = []

        def run() -> None:
            try:
                self._box.append(Outcome(value=call()))
            except Exception as exc:  # reported to the caller, who names the address
                self._box.append(Outcome(error=exc))
            finally:
                self.wake.set()

        self._thread = CallThread(run, name)

    @property
    def outcome(self) -> Outcome[T] | None:
        """What the call returned or raised; None while it runs."""
        return self._box[0] if self._box else None

    def give_up(self, *, wait_at_exit: bool = True) -> Outcome[T]:
        """The outcome, or a pending one: the thread is then waited for a little at exit,
        unless the caller knows it cannot come back soon (``wait_at_exit=False``)."""
        if self._box:
            return self._box[0]
        if wait_at_exit:
            if not _PENDING:  # a step of the one exit path (ddpkit.worker.exit)
                from ddpkit.worker import exit as process_exit

                process_exit.add(process_exit.PENDING, "wait for bounded calls", _wait_for_pending)
            _PENDING.append(self._thread)
        return Outcome(pending=self._thread)


class CallThread:
    """A daemon thread running ``run`` once, made with the low-level :mod:`_thread` API.

    ``threading.Thread.start`` waits until the new thread has run (one more switch of the GIL
    and of the CPU between the two, for every rank's client): measured with 4,096 simulated
    ranks, 16 to a process, the rank's own thread spent 0.11-0.19 ms of CPU connecting instead
    of 0.15-0.25, and the job formed 3-23% sooner (4 pairs of runs, scale_phases.py). Without
    a ``threading`` object, :func:`running` counts the threads of a name (for tests). In a
    child forked meanwhile the thread does not exist: it is not alive there, and not waited for.
    """

    def __init__(self, run: Callable[[], None], name: str) -> None:
        self._pid = os.getpid()
        self._done = _thread.allocate_lock()
        self._done.acquire()
        _RUNNING.add(name, 1)

        def body() -> None:
            try:
                run()
            finally:
                _RUNNING.add(name, -1)
                self._done.release()

        try:
            _thread.start_new_thread(body, ())
        except BaseException:  # no thread (e.g. a process limit): nothing runs, nothing held
            _RUNNING.add(name, -1)
            self._done.release()
            raise

    def is_alive(self) -> bool:
        return self._pid == os.getpid() and self._done.locked()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for ``run`` to return (or raise)."""
        if self.is_alive() and self._done.acquire(timeout=max(0.0, timeout)):
            self._done.release()


class _Running:
    """How many :class:`CallThread` of each name run, under a lock of its own."""

    lock: _thread.LockType
    counts: dict[str, int]

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.lock = _thread.allocate_lock()
        self.counts = {}

    def add(self, name: str, delta: int) -> None:
        with self.lock:
            count = self.counts.get(name, 0) + delta
            if count:
                self.counts[name] = count
            else:
                self.counts.pop(name, None)


_RUNNING = _Running()


def running(name: str) -> int:
    """How many :class:`CallThread` of ``name`` are still running in this process."""
    with _RUNNING.lock:
        return _RUNNING.counts.get(name, 0)


def _forked() -> None:
    """In a forked child: no thread of the parent runs here (a lock one held stays held)."""
    _RUNNING.reset()
    _PENDING.clear()


os.register_at_fork(after_in_child=_forked)


def bounded(call: Callable[[], T], bound_s: float, name: str) -> Outcome[T]:
    """``call()`` in a daemon thread (a :class:`Call`), waited for ``bound_s`` at most."""
    made = Call(call, name)
    made.wake.wait(bound_s)
    return made.give_up()


def _wait_for_pending() -> None:
    deadline = time.monotonic() + _EXIT_WAIT_S
    for thread in _PENDING:
        thread.join(max(0.0, deadline - time.monotonic()))
