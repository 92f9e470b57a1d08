"""Hold-and-forward: a process that blocks the stop signal and passes it on to its children.

The one implementation behind the three processes that stand between SLURM and a worker: each
srun task's holder (:mod:`.hold`, in sbatch jobs), submitit's task runner
(:mod:`ddpkit.launch.submitit_task`) and the ``ddpkit run`` launcher (:mod:`ddpkit.launch.relay`).

* :func:`block` blocks the stop signal in the calling thread and so in every thread and process
  it starts from then on: one that comes waits, pending, and nothing dies of it. A child starts
  with it blocked, so it stays pending there until ``ddpkit.init()`` or ``preemption_guard()``
  latches it (a command that handles it itself must unblock it).
* The relay thread (:func:`start`) takes each arrival and sends it to the children (this
  process's, less the zombies and the helpers it names with :func:`not_a_worker`); one that
  finds no child running (before it starts, between two groups of ``--max-restarts``) is kept,
  and sent to the next children as soon as they exist. :func:`arrivals` counts them.

This module imports nothing but the standard library and :mod:`.signals`: the launcher runs it
from its first line. Children are found in ``/proc``: elsewhere than on Linux a holder holds
the signal (it does not die of it) but passes nothing on.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from types import FrameType

__all__ = [
    "arrivals",
    "block",
    "child_pids",
    "forget",
    "forward_now",
    "held",
    "ignore_at_exit",
    "not_a_worker",
    "start",
    "workers",
]

_POLL_S = 0.05  # how often a kept stop signal looks for workers
_IDLE_S = 1.0
# multiprocessing's helpers started by a --run-path launch: children, but not workers
_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


class _State:
    """This process's relay (one per process: signal dispositions are process-wide)."""

    def __init__(self) -> None:
        self.held: signal.Signals | None = None
        self.arrivals = 0  # stop signals taken by the relay thread
        self.relay: threading.Thread | None = None
        self.arrived = False  # by the fallback handler: a thread that does not block it
        self.not_workers: set[int] = set()
        # held while a non-worker child is being started: between its fork and its record in
        # not_workers it would look like a worker, and a kept signal sent to it would be lost
        self.starting = threading.Lock()


_STATE = _State()


def block(stop: signal.Signals) -> None:
    """Block ``stop`` in this thread (and what it starts from now on); a handler that keeps an
    arrival catches it in a thread started earlier that does not block it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [stop])
    if threading.current_thread() is threading.main_thread():
        signal.signal(stop, _keep)
    _STATE.held = stop


def held() -> signal.Signals | None:
    """The stop signal :func:`block` blocked in this process, or None."""
    return _STATE.held


def arrivals() -> int:
    """How many stop signals the relay thread has taken so far."""
    return _STATE.arrivals


def start(stop: signal.Signals) -> None:
    """Start the relay thread for ``stop`` (once per process); ``stop`` must be blocked in
    this thread already, so that the relay thread inherits the block, as sigwait needs."""
    if _STATE.relay is not None:
        return
    _STATE.relay = threading.Thread(
        target=_relay, args=(stop,), name="ddpkit-stop-relay", daemon=True
    )
    _STATE.relay.start()


def _relay(stop: signal.Signals) -> None:
    kept = False
    while True:
        # short waits only while a signal is kept for the workers; else the wait is mostly
        # sigwait's, waking now and then for an arrival the fallback handler caught
        if _wait(stop, _POLL_S if kept else _IDLE_S) or _STATE.arrived:
            _STATE.arrived, kept = False, True
            _STATE.arrivals += 1
        if kept:
            with _STATE.starting:
                kept = not _send(stop, workers())


def _wait(stop: signal.Signals, timeout_s: float) -> bool:
    """Whether ``stop`` came within ``timeout_s`` (macOS has no sigtimedwait: until it comes)."""
    if hasattr(signal, "sigtimedwait"):
        return signal.sigtimedwait([stop], timeout_s) is not None
    signal.sigwait([stop])
    return True


def _keep(signum: int, frame: FrameType | None) -> None:
    _STATE.arrived = True


def forward_now(signum: int, frame: FrameType | None) -> None:
    """A handler passing ``signum`` on to the running children at once (none: dropped)."""
    _send(signum, workers())


def _send(signum: int, pids: Iterable[int]) -> bool:
    """Send ``signum`` to each of ``pids``; whether one got it."""
    sent = False
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
            sent = True
    return sent


def ignore_at_exit(signals: list[signal.Signals]) -> None:
    """Ignore ``signals`` (an atexit handler: finalization would restore their default action
    while torch tears down)."""
    for sig in signals:
        with suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_IGN)


@contextmanager
def not_a_worker() -> Iterator[Callable[[int], None]]:
    """Around the start of a child that is no worker (the sweeper of :mod:`.deathsig`): call
    the function yielded with its pid. The relay sends nothing meanwhile."""
    with _STATE.starting:
        yield _STATE.not_workers.add


def forget(pid: int) -> None:
    """``pid``, recorded by :func:`not_a_worker`, has been reaped: it may be a worker's now."""
    _STATE.not_workers.discard(pid)


def workers(proc: str = "/proc") -> list[int]:
    """The running workers: this process's children, less zombies (a worker that has ended)
    and the launcher's helpers."""
    found = []
    for pid in child_pids(proc=proc, running=True):
        if pid in _STATE.not_workers:
            continue
        try:
            with open(os.path.join(proc, str(pid), "cmdline"), "rb") as cmdline:
                argv = cmdline.read()
        except OSError:
            continue
        if not any(helper in argv for helper in _HELPERS):
            found.append(pid)
    return found


def child_pids(
    parent: int | None = None, proc: str = "/proc", *, running: bool = False
) -> list[int]:
    """The direct children of ``parent`` (default: this process), read from ``/proc``;
    ``running``: not the zombies among them. Empty where there is no ``/proc`` (not Linux)."""
    wanted = str(os.getpid() if parent is None else parent)
    found: list[int] = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "stat"), encoding="utf-8") as stat:
                text = stat.read()
        except OSError:  # the process ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = text[text.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1] == wanted and not (running and fields[0] in "ZX"):
            found.append(int(entry))
    return sorted(found)
