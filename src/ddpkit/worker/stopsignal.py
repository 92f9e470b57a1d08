"""The stop-signal latch: a handler that only records that the signal came.

A signal's default action (for USR1/USR2: end the process) must not hit a rank that has not
reached its training loop yet, so ``ddpkit.init()`` latches ``DDPKIT_SIGNAL`` (which ddpkit's
job scripts set) as its first step, and ``ddpkit.preemption_guard()`` reads the latch: a
signal that came during start-up, model building or the checkpoint load is not lost. The
handler does nothing else (no I/O, no collectives): the decision is taken at a step boundary.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Mapping
from types import FrameType

from ddpkit.worker.requeue import SIGNAL_VAR, parse_signal

__all__ = ["clear", "latch", "latch_from_env", "received"]

_RECEIVED: set[int] = set()
_LATCHED: set[int] = set()


def _record(signum: int, frame: FrameType | None) -> None:
    _RECEIVED.add(signum)


def latch(sig: signal.Signals) -> bool:
    """Bind ``sig`` to the latch (once); False outside the main thread, where Python cannot."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(sig) is not _record:
        signal.signal(sig, _record)  # replaces e.g. submitit's requeue-at-once handler
    _LATCHED.add(int(sig))
    return True


def latch_from_env(env: Mapping[str, str]) -> signal.Signals | None:
    """Latch ``DDPKIT_SIGNAL`` when it is set (a ddpkit job script); the signal, or None."""
    text = env.get(SIGNAL_VAR, "").strip()
    if not text:
        return None
    sig = parse_signal(text)
    return sig if latch(sig) else None


def received(sig: signal.Signals) -> bool:
    """True once ``sig`` arrived while latched."""
    return int(sig) in _RECEIVED


def clear(sig: signal.Signals) -> None:
    """Forget an arrival of ``sig`` (tests; a guard that handled it)."""
    _RECEIVED.discard(int(sig))
