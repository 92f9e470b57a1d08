"""Hold-and-forward: a process that blocks the stop signal and passes it on to its children.

The one implementation behind the three processes between SLURM and a worker: each srun task's
holder (:mod:`.hold`, in sbatch jobs), submitit's task runner (:mod:`ddpkit.launch.submitit_task`)
and the ``ddpkit run`` launcher (:mod:`ddpkit.launch.relay`).

* :func:`block` blocks the stop signal in the calling thread, and so in every thread and process
  it starts from then on: an arrival waits, pending, and nothing dies of it; a child keeps it
  pending until ``ddpkit.init()`` or ``preemption_guard()`` latches it.
* The relay thread (:func:`start`) sends each arrival to the workers (this process's children,
  less zombies, the helpers named with :func:`not_a_worker` and the children that have not
  exec'd yet, which would die of it: :func:`workers`); with none running (before they start,
  between two groups of ``--max-restarts``) it keeps it for the next ones.
* ``catching_only`` (``ddpkit run`` outside a ddpkit job, whose workers must get what they would
  get under torchrun): :func:`release` gives the thread that starts the children its original
  mask back, and an arrival goes only to the children that catch the signal (its bit in
  ``SigCgt`` of ``/proc/<pid>/status``), for the others would die of it. It is owed to each
  child running when it came (none: to the next group, once two looks in a row find the same
  children) and sent as soon as the child catches it. An arrival another thread takes reaches
  the relay through :func:`block`'s handler. While an arrival is kept or owed the relay looks
  every 50 ms, backing off to every 0.5 s while nothing changes.

Standard library only: the launcher runs it from its first line. Children are found in
``/proc``: elsewhere than on Linux a holder holds the signal but passes nothing on.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from types import FrameType

__all__ = [
    "arrivals",
    "block",
    "catches",
    "child_pids",
    "forget",
    "forward_now",
    "held",
    "ignore_at_exit",
    "not_a_worker",
    "release",
    "start",
    "workers",
]

_POLL_S = 0.05  # how often a kept stop signal looks for workers
_BACKOFF_S = 0.5  # catching only: the longest wait between two looks while nothing changes
_IDLE_S = 1.0
# multiprocessing's helpers started by a --run-path launch: children, but not workers
_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


class _State:
    """This process's relay (one per process: signal dispositions are process-wide)."""

    def __init__(self) -> None:
        self.held: signal.Signals | None = None
        self.arrivals = 0  # stop signals taken by the relay thread
        self.relay: threading.Thread | None = None
        self.catching_only = False  # the relay sends only to children that catch the signal
        self.blocked_before = False  # block() found the signal blocked already
        self.released = False  # release() registered the signal's ignoring at exit
        self.arrived = False  # by the fallback handler, while no relay thread runs
        self.forwarding: set[int] = set()  # the signals forward_now is passing on now
        self.not_workers: set[int] = set()
        # held while a non-worker child is being started: between its fork and its record in
        # not_workers it would look like a worker, and a kept signal sent to it would be lost
        self.starting = threading.Lock()


_STATE = _State()


def block(stop: signal.Signals) -> None:
    """Block ``stop`` in this thread (and what it starts from now on); a handler hands an
    arrival that a thread not blocking it takes (one started earlier, or after
    :func:`release`) to the relay thread."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [stop])
    if threading.current_thread() is threading.main_thread():
        signal.signal(stop, _keep)
    if _STATE.held != stop:
        _STATE.blocked_before = stop in before
    _STATE.held = stop


def held() -> signal.Signals | None:
    """The stop signal :func:`block` blocked in this process, or None."""
    return _STATE.held


def arrivals() -> int:
    """How many stop signals the relay thread has taken so far."""
    return _STATE.arrivals


def start(stop: signal.Signals, *, catching_only: bool = False) -> bool:
    """Start the relay thread for ``stop`` (once per process); ``stop`` must be blocked in
    this thread already, so that the relay thread inherits the block, as sigwait needs.
    ``catching_only``: see the module docstring; the caller then calls :func:`release`.
    Whether the relay thread (this one, or one started before) sends only to those."""
    if _STATE.relay is None:
        _STATE.catching_only = catching_only
        _STATE.relay = threading.Thread(
            target=_relay, args=(stop, catching_only), name="ddpkit-stop-relay", daemon=True
        )
        _STATE.relay.start()
    return _STATE.catching_only


def release(stop: signal.Signals) -> None:
    """With a ``catching_only`` relay: put ``stop`` in this thread's mask back as :func:`block`
    found it, so the children it starts get the mask this process started with; ``stop`` is
    ignored from the atexit handlers on (finalization would restore its default action)."""
    if _STATE.relay is None or not _STATE.catching_only:
        raise RuntimeError("release() needs a relay thread started with catching_only")
    if not _STATE.blocked_before:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [stop])
    if not _STATE.released:
        atexit.register(ignore_at_exit, [stop])
        _STATE.released = True


def _relay(stop: signal.Signals, catching_only: bool) -> None:
    kept = False  # an arrival not yet sent to any worker (sending to every worker)
    owing = _Owing(stop)  # catching only
    wait_s = _POLL_S
    while True:
        busy = owing.busy() if catching_only else kept
        # short waits only while a signal is kept for the workers; else the wait is mostly
        # sigwait's, waking now and then for an arrival the fallback handler caught
        if _wait(stop, wait_s if busy else _IDLE_S) or _STATE.arrived:
            _STATE.arrived = False
            _STATE.arrivals += 1
            owing.kept = catching_only
            kept = not catching_only
            wait_s = _POLL_S
        if owing.busy():
            changed = owing.pass_on()
            wait_s = _POLL_S if changed else min(2 * wait_s, _BACKOFF_S)
        elif kept:
            with _STATE.starting:
                kept = not _send(stop, workers())


class _Owing:
    """Catching only: an arrival is owed to the workers running when it came (or to the next
    ones), and sent to each once it catches it."""

    def __init__(self, stop: signal.Signals) -> None:
        self.stop = stop
        self.kept = False  # an arrival not yet owed to any worker
        self.seen: list[int] = []  # the workers the last look found, while one is kept
        self.owed: set[int] = set()

    def busy(self) -> bool:
        return self.kept or bool(self.owed)

    def pass_on(self) -> bool:
        """One look: a kept arrival becomes owed to the running workers once two looks in a row
        found the same ones (torch starts a group's workers one by one: all of them); each owed
        worker that catches it gets it, one that ended drops it. Whether anything changed."""
        changed = False
        with _STATE.starting:
            if self.kept:
                running = workers()
                if running and running == self.seen:
                    self.owed.update(running)
                    self.kept, self.seen, changed = False, [], True
                elif running != self.seen:
                    self.seen, changed = running, True
            for pid in sorted(self.owed):
                catching = catches(pid, self.stop)
                if catching is None or (catching and _send(self.stop, [pid])):
                    self.owed.discard(pid)
                    changed = True
        return changed


def catches(pid: int, sig: int, proc: str = "/proc") -> bool | None:
    """Whether ``pid``, a running child of this process, catches ``sig`` (a handler of its
    own: its bit in ``SigCgt``); None when it is not one (ended, a zombie, or another's)."""
    try:
        with open(os.path.join(proc, str(pid), "status"), encoding="utf-8") as status:
            text = status.read()
    except OSError:
        return None
    fields = dict(line.partition(":")[::2] for line in text.splitlines())
    try:
        state, parent, caught = fields["State"].split(), fields["PPid"], fields["SigCgt"]
        if not state or state[0] in "ZX" or int(parent) != os.getpid():
            return None
        return bool(int(caught, 16) >> (int(sig) - 1) & 1)
    except (KeyError, ValueError):
        return None


def _wait(stop: signal.Signals, timeout_s: float) -> bool:
    """Whether ``stop`` came within ``timeout_s`` (macOS has no sigtimedwait: until it comes)."""
    if hasattr(signal, "sigtimedwait"):
        return signal.sigtimedwait([stop], timeout_s) is not None
    signal.sigwait([stop])
    return True


def _keep(signum: int, frame: FrameType | None) -> None:
    """An arrival a thread that does not block it took: the relay thread's, at once."""
    relay = _STATE.relay
    if relay is not None and relay.ident is not None and relay.is_alive():
        # thread-directed: pending in the relay thread (which blocks it) until its sigwait
        with suppress(OSError):
            signal.pthread_kill(relay.ident, signum)
            return
    _STATE.arrived = True


def forward_now(signum: int, frame: FrameType | None) -> None:
    """A handler passing ``signum`` on to the running children at once (none: dropped).

    Not re-entered for one signal: an arrival while a forward of that signal runs joins it, as
    the kernel merges a pending standard signal; re-entered, a storm of arrivals faster than one
    scan of /proc nested handlers until a RecursionError ended the launcher."""
    if signum in _STATE.forwarding:
        return
    _STATE.forwarding.add(signum)
    try:
        _send(signum, workers())
    finally:
        _STATE.forwarding.discard(signum)


def _send(signum: int, pids: Iterable[int]) -> bool:
    """Send ``signum`` to each of ``pids``; whether one got it."""
    sent = False
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
            sent = True
    return sent


def ignore_at_exit(signals: Iterable[int]) -> None:
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
    """The running workers: this process's children, less zombies (a worker that has ended),
    the launcher's helpers and the children that have not exec'd yet.

    A child between its fork and its exec runs this process's image (its command line is this
    process's): under CPython's vfork it blocks every signal and shows this process's handlers
    in ``SigCgt``, then restores the default actions and unblocks, and a signal sent meanwhile
    kills it before its program starts. It is a worker once its command line is its own."""
    found = []
    own = _cmdline(os.getpid(), proc)
    for pid in child_pids(proc=proc, running=True):
        if pid in _STATE.not_workers:
            continue
        argv = _cmdline(pid, proc)
        if argv is None or argv == own:
            continue
        if not any(helper in argv for helper in _HELPERS):
            found.append(pid)
    return found


def _cmdline(pid: int, proc: str) -> bytes | None:
    """``pid``'s command line as ``/proc`` has it; None when it cannot be read."""
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as cmdline:
            return cmdline.read()
    except OSError:
        return None


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
