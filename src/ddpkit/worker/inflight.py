"""The one checkpoint write that may run in the background, and waiting for it, bounded.

:func:`start` hands the main rank's write to a thread (at a lower CPU priority than the
training) and records the save on every rank. :func:`finish` is the collective that ends it:
the main rank waits for its thread (at most ``timeout_s``) and tells every rank the outcome;
every rank raises :class:`CheckpointError` when the write failed or timed out. Every save, load,
wait and ``requeue_and_exit`` calls it first, so at most one write is ever in flight and a new
checkpoint is never numbered before the previous one is in place.

At exit (a step of :mod:`ddpkit.worker.exit`) a write still in flight is waited for and its
outcome reaches every rank through the store (a collective could wait for peers that never
join it), each rank's step ending within the save's ``timeout_s``; a failure prints the error
and exits with code 1. After ``ddpkit.shutdown()`` only the main rank knows: wait before.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ddpkit import compat
from ddpkit.errors import CheckpointError
from ddpkit.worker import exit as process_exit
from ddpkit.worker.agree import broadcast, describe
from ddpkit.worker.watchdog.flight import patient

__all__ = ["WAIT_TIMEOUT_S", "finish", "in_flight", "start", "write_failed"]

# The default bound of a wait for the write in flight: below the collective timeouts, as the
# other ranks wait in a collective meanwhile.
WAIT_TIMEOUT_S = 300.0
_NICER = 10  # how much lower the writer thread's CPU priority is than the training's
# At exit, the most time ranks may reach their exit apart (see _apart_s).
_APART_S = 30.0
# (kind, text, hint): kind "failed" or "timeout"; None when the write succeeded
_Outcome = tuple[str, str, str | None] | None


@dataclass
class _Write:
    """One save in flight; ``thread`` only on the main rank."""

    step: int
    folder: Path
    timeout_s: float
    rank: int
    world_size: int
    generation: int
    thread: threading.Thread | None = None
    path: Path | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _State:
    pending: _Write | None = None
    generation: int = 0


_STATE = _State()


def in_flight() -> bool:
    """True while a save started in the background has not been waited for."""
    return _STATE.pending is not None


def start(
    step: int,
    folder: Path,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    write: Callable[[], Path] | None,
) -> _Write:
    """Record a background save on this rank; run ``write`` in a thread (the main rank's)."""
    if _STATE.pending is not None:  # the callers finish() first; a bug if not
        raise RuntimeError("a checkpoint write is still in flight")
    _STATE.generation += 1
    pending = _Write(step, folder, timeout_s, rank, world_size, _STATE.generation)
    if write is not None:
        pending.thread = threading.Thread(
            target=_run, args=(pending, write), name=f"ddpkit-checkpoint-{step}", daemon=True
        )
        pending.thread.start()
    else:
        pending.done.set()
    _STATE.pending = pending
    process_exit.add(process_exit.SHARE, "share the background write's outcome", _at_exit)
    return pending


def _run(pending: _Write, write: Callable[[], Path]) -> None:
    _yield_to_training()
    try:
        pending.path = write()
    except BaseException as error:  # kept for every rank to raise at the next wait
        pending.error = error
    finally:
        pending.done.set()


def _yield_to_training() -> None:
    """Lower this thread's CPU priority (on Linux a thread has its own nice value), so the
    write takes the CPU the training leaves; where that fails it keeps the process's."""
    with contextlib.suppress(OSError, AttributeError):
        thread = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + _NICER)
        )


def finish(world_size: int, *, timeout_s: float | None = None) -> Path | None:
    """End the save in flight, if any; a collective. Returns its path on the main rank.

    Every rank raises :class:`CheckpointError` when the write failed (the save is over: the
    checkpoints before it stay the newest) or did not finish within ``timeout_s`` (default:
    the save's own; it stays in flight, and the next wait waits for it again).
    """
    pending = _STATE.pending
    if pending is None:
        return None
    outcome = _outcome(pending, timeout_s) if pending.thread is not None else None
    with patient():  # the others wait while rank 0 finishes the write: not a hang
        outcome = broadcast(world_size, outcome)
    if outcome is None or outcome[0] == "failed":
        _STATE.pending = None
    if outcome is None:
        return pending.path
    raise _error(pending, outcome) from pending.error


def _outcome(pending: _Write, timeout_s: float | None, *, said_s: float | None = None) -> _Outcome:
    """The main rank's view of its write, after waiting for it at most ``timeout_s``; a timeout
    names ``said_s`` (default: that bound), the one the user set, which an exit step shares."""
    bound = pending.timeout_s if timeout_s is None else timeout_s
    if not pending.done.wait(bound):
        said = bound if said_s is None else said_s
        return (
            "timeout",
            f"the write did not finish within {said:g} s (still writing in the background)",
            "pass a larger timeout_s to async_save_checkpoint or wait(), or check the "
            "filesystem's speed and free space",
        )
    failure = describe(pending.error)
    return None if failure is None else ("failed", *failure)


def write_failed(
    step: int, folder: object, text: str, hint: str | None, *, how: str = ""
) -> CheckpointError:
    """The error every rank raises when the main rank failed to write checkpoint ``step``."""
    return CheckpointError(
        f"the main rank (rank 0) failed to write checkpoint step {step} to {folder}{how}: {text}",
        hint=hint
        or f"check that {folder} is (or can be created as) a writable directory with enough "
        "free space, and that every value in the state can be pickled; the checkpoints "
        "already there are untouched",
    )


def _error(pending: _Write, outcome: tuple[str, str, str | None]) -> CheckpointError:
    return write_failed(pending.step, pending.folder, *outcome[1:], how=" in the background")


# --- at exit -----------------------------------------------------------------------------------


def _at_exit() -> int | None:
    """The exit step: the write's outcome on every rank; 1 (the exit code) when it failed."""
    pending = _STATE.pending
    if pending is None:
        return None
    _STATE.pending = None
    crashed = getattr(sys, "last_value", None) is not None  # an uncaught exception ends us
    shares = pending.world_size > 1 and not crashed
    shares = shares and dist.is_available() and dist.is_initialized()
    outcome = None
    if pending.thread is not None:
        bound = pending.timeout_s - (_apart_s(pending.timeout_s) if shares else 0.0)
        outcome = _outcome(pending, bound, said_s=pending.timeout_s)
    if shares:
        outcome = _share_at_exit(pending, outcome)
    if outcome is None:
        return None
    print(f"ddpkit: error: {_error(pending, outcome)}", file=sys.stderr, flush=True)
    return 1


def _apart_s(timeout_s: float) -> float:
    """How far apart ranks may reach their exit and still learn the outcome, each within
    ``timeout_s``: the main rank's write gets this much less, the store stays up this long."""
    return min(_APART_S, timeout_s / 10)


def _share_at_exit(pending: _Write, outcome: _Outcome) -> _Outcome:
    """The main rank's outcome on every rank, through the store (bounded waits)."""
    store = compat.default_store()
    key = f"ddpkit/checkpoint-write/{pending.generation}"
    try:
        if pending.rank == 0:
            store.set(key, "" if outcome is None else "\0".join([*outcome[:2], outcome[2] or ""]))
            # keep the store up while they read: the rest of this rank's bound at most
            deadline = time.monotonic() + _apart_s(pending.timeout_s)
            while store.add(f"{key}/read", 0) < pending.world_size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(0.01, left))
            return outcome
        # the main rank's write gets timeout_s less the time ranks reach their exit apart
        store.wait([key], timedelta(seconds=pending.timeout_s))
        text = store.get(key).decode()
        store.add(f"{key}/read", 1)
    except Exception as error:  # a store gone with the main rank: say so, do not hang
        return "failed", f"its outcome could not be read at exit ({error})", None
    if not text:
        return None
    kind, message, hint = text.split("\0")
    return kind, message, hint or None
