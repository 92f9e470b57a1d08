"""The launcher's SIGUSR1/SIGUSR2, from its first line to its exit: passed on, never deadly.

``ddpkit run`` passes SIGUSR1 and SIGUSR2 on to its workers (torch's agent would die of them).
Their default action ends a process, so a launcher that handled them only while torch's agent
ran died of one (exit 140) while Python and torch started (seconds), between two worker groups
and while it tore down. The ``ddpkit`` entry point calls :func:`hold` first thing, before
anything heavy is imported; for ``ddpkit run``:

* The stop signal (``DDPKIT_SIGNAL``, else SIGUSR2) is blocked from then on, in the launcher
  and so in every thread and process it starts: one that comes waits, pending, and nothing
  dies of it. The relay thread (:func:`start`) takes each arrival and sends it to the workers;
  one that finds no worker running (before they start, between two groups of
  ``--max-restarts``) is kept, and sent to the next workers as soon as they exist. A worker
  starts with the signal blocked, so it waits there until ``ddpkit.init()`` or
  ``preemption_guard()`` latches it (a script that handles it itself must unblock it). After
  the last workers, a signal is kept and dropped at exit: the run ends as its workers did.
* The other of SIGUSR1/SIGUSR2 gets a handler that sends it to the running workers (none:
  dropped), ignored from the atexit handlers on: Python's finalization would restore the
  default action while torch tears down.

Out of reach: the interpreter's own start, until the entry point's first line (some tens of
milliseconds). This module imports nothing but the standard library, for that reason. The
workers are found in ``/proc``: elsewhere than on Linux the launcher holds the signals (it does
not die of them) but passes nothing on; on Windows it holds nothing.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from types import FrameType

__all__ = [
    "FORWARDED",
    "child_pids",
    "forget",
    "held",
    "hold",
    "not_a_worker",
    "start",
    "stop_signal_from",
    "workers",
]

# getattr: neither exists on Windows, where the launcher holds nothing
FORWARDED = tuple(getattr(signal, name) for name in ("SIGUSR1", "SIGUSR2") if hasattr(signal, name))
_DEFAULT_STOP: signal.Signals = getattr(signal, "SIGUSR2", signal.SIGTERM)
# ddpkit.worker.requeue.ALLOWED_SIGNALS (not imported: 30 ms of imports before the hold)
_STOP_NAMES = ("USR1", "USR2", "HUP", "INT", "TERM", "URG", "XCPU")
_POLL_S = 0.05  # how often a kept stop signal looks for workers
_IDLE_S = 1.0
# multiprocessing's helpers started by a --run-path launch: children, but not workers
_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


class _State:
    """This process's relay (one per process: signal dispositions are process-wide)."""

    def __init__(self) -> None:
        self.held: signal.Signals | None = None
        self.relay: threading.Thread | None = None
        self.arrived = False  # by the fallback handler: a thread that does not block it
        self.not_workers: set[int] = set()
        # held while a non-worker child is being started: between its fork and its record in
        # not_workers it would look like a worker, and a kept signal sent to it would be lost
        self.starting = threading.Lock()


_STATE = _State()


def stop_signal_from(env: Mapping[str, str]) -> signal.Signals:
    """``DDPKIT_SIGNAL``'s signal, leniently (SIGUSR2 when unset or not one ddpkit stops on:
    the launcher reports that one later, as the usual one-line error)."""
    text = env.get("DDPKIT_SIGNAL", "").strip().upper()
    if text.isascii() and text.isdigit():
        with suppress(ValueError):
            text = signal.Signals(int(text)).name
    name = text[3:] if text.startswith("SIG") else text
    found = getattr(signal, f"SIG{name}", None) if name in _STOP_NAMES else None
    return found if isinstance(found, signal.Signals) else _DEFAULT_STOP


def hold(argv: Sequence[str], env: Mapping[str, str]) -> signal.Signals | None:
    """First thing in the ``ddpkit`` process: for ``ddpkit run``, block the stop signal and
    handle the other forwarded one (see the module docstring); the stop signal, or None."""
    if not argv or argv[0] != "run" or threading.current_thread() is not threading.main_thread():
        return None
    if not FORWARDED or not hasattr(signal, "pthread_sigmask"):  # not a POSIX system
        return None
    stop = stop_signal_from(env)
    block(stop)
    for sig in FORWARDED:
        if sig != stop:
            signal.signal(sig, _forward_now)
    atexit.register(_ignore_at_exit, [sig for sig in FORWARDED if sig != stop])
    return stop


def block(stop: signal.Signals) -> None:
    """Block ``stop`` in this thread (and what it starts from now on); a handler that keeps an
    arrival catches it in a thread started earlier that does not block it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [stop])
    if threading.current_thread() is threading.main_thread():
        signal.signal(stop, _keep)
    _STATE.held = stop


def held() -> signal.Signals | None:
    """The stop signal :func:`hold` or :func:`block` blocked in this process, or None."""
    return _STATE.held


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


def _forward_now(signum: int, frame: FrameType | None) -> None:
    _send(signum, workers())


def _send(signum: int, pids: Iterable[int]) -> bool:
    """Send ``signum`` to each of ``pids``; whether one got it."""
    sent = False
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
            sent = True
    return sent


def _ignore_at_exit(signals: list[signal.Signals]) -> None:
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
