"""The stop-signal latch: a handler that only records that the signal came, from init() to exit.

A signal's default action (for USR1/USR2: end the process) must not hit a rank that has not
reached its training loop yet, so ``ddpkit.init()`` latches ``DDPKIT_SIGNAL`` (which ddpkit's
job scripts set) as its first step, and ``ddpkit.preemption_guard()`` reads the latch at a step
boundary: a signal that came during start-up or the checkpoint load is not lost. The handler
does nothing else (no I/O, no collectives).

* At exit the latched signals are ignored instead (an atexit handler registered at import, so
  it runs after ddpkit's other ones): Python's finalization restores their default action and
  then takes up to seconds to tear torch down, and a signal then would kill a finished run
  (SLURM would record it as FAILED). Nobody reads the latch by then.
* Latching unblocks the signal in the calling thread: a parent that started this process with
  it blocked (:mod:`ddpkit.cluster.stop.forward`) kept an earlier arrival pending, and it is
  recorded the moment the handler is in place.
* With ``DDPKIT_LATCH_DIR`` set (ddpkit's sbatch scripts set it to a fresh folder of the job),
  :func:`latch_from_env` creates ``<host>.<pid>`` there once the handler is in place: the batch
  shell holds SLURM's warning until every process has one, then passes it on.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from ddpkit.cluster.stop import forward
from ddpkit.cluster.stop.signals import signal_from_env
from ddpkit.contract import LATCH_DIR_VAR, SIGNAL_VAR

__all__ = ["announce", "clear", "latch", "latch_from_env", "received"]


_RECEIVED: set[int] = set()
_LATCHED: set[int] = set()


def _record(signum: int, frame: FrameType | None) -> None:
    _RECEIVED.add(signum)


def latch(sig: signal.Signals) -> bool:
    """Bind ``sig`` to the latch (once) until exit; False outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(sig) is not _record:
        # replaces the default action, SIG_IGN (a wrapper's deferral) or e.g. submitit's
        # requeue-at-once handler
        signal.signal(sig, _record)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])  # a pending one is recorded now
    _LATCHED.add(int(sig))
    return True


# at import: after every handler registered later; the set is read at exit
atexit.register(forward.ignore_at_exit, _LATCHED)


def latch_from_env(env: Mapping[str, str]) -> signal.Signals | None:
    """Latch ``DDPKIT_SIGNAL`` when it is set (a ddpkit job script) and announce it; the signal,
    or None."""
    sig = signal_from_env(env)
    if sig is None or not latch(sig):
        return None
    announce(env)
    return sig


def announce(env: Mapping[str, str]) -> None:
    """Create this process's marker in ``DDPKIT_LATCH_DIR``, if set: "latched, signal away"."""
    where = env.get(LATCH_DIR_VAR, "").strip()
    if where:
        marker = Path(where) / f"{socket.gethostname()}.{os.getpid()}"
        try:
            marker.touch()
        except OSError as exc:
            warnings.warn(
                f"ddpkit: cannot create {marker} ({exc.strerror}): the batch shell will hold "
                f"the stop signal {env.get(SIGNAL_VAR)} back from this job (is {where} on a "
                "filesystem every node shares?)",
                RuntimeWarning,
                stacklevel=3,
            )


def received(sig: signal.Signals) -> bool:
    """True once ``sig`` arrived while latched."""
    return int(sig) in _RECEIVED


def clear(sig: signal.Signals) -> None:
    """Forget an arrival of ``sig`` (tests; a guard that handled it)."""
    _RECEIVED.discard(int(sig))
