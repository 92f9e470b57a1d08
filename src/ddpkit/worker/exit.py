"""The worker process's one exit path: ddpkit's at-exit steps, in a fixed order, from one handler.

Each module that has something to do at exit registers a step here (:func:`add`) instead of
with :mod:`atexit`; one atexit handler runs them in this order:

1. ``MARKER``: the peer watchdog stops and writes this rank's exit marker (first: a rank that
   waits in a later step is not judged by its own watchdog, and its peers learn that it left
   before its group's sockets close).
2. ``SHARE``: the outcome of a checkpoint write still in flight goes to every rank, bounded
   (:mod:`ddpkit.worker.inflight`).
3. ``DESTROY``: the process group ddpkit made is destroyed (:mod:`ddpkit.worker.context`).
4. ``SIGNALS``: the latched stop signal is ignored to the end (:mod:`ddpkit.cluster.stop.latch`
   registers its own handler at import, so it runs after this one).

A step may ask for an exit code: the later steps still run, then the process ends with it
(:func:`hard_exit`, which flushes stdout and stderr first). Nothing runs in a forked child (a
data loader worker): the steps belong to the process that registered them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable

__all__ = ["DESTROY", "MARKER", "SHARE", "add", "hard_exit", "run"]

MARKER, SHARE, DESTROY = 10, 20, 30

# order -> (name, step); a step returns an exit code to end the process with, or None
_STEPS: dict[int, tuple[str, Callable[[], int | None]]] = {}
_OWNER: list[int] = []  # the pid whose handler is registered


def add(order: int, name: str, step: Callable[[], int | None]) -> None:
    """Run ``step`` at exit in its ``order`` (one step an order; a second replaces it)."""
    _STEPS[order] = (name, step)
    if [os.getpid()] != _OWNER:
        _OWNER[:] = [os.getpid()]
        atexit.register(run)


def run() -> None:
    """Run the steps in order (the atexit handler); each one's failure is reported and the
    next runs. Ends the process with the first code a step asked for, after the last step."""
    if [os.getpid()] != _OWNER:
        return
    code: int | None = None
    for order in sorted(_STEPS):
        name, step = _STEPS.pop(order)
        try:
            asked = step()
        except Exception as error:  # never skip the later steps
            with contextlib.suppress(Exception):
                text = f"ddpkit: the exit step {name!r} failed ({type(error).__name__}: {error})"
                print(text, file=sys.stderr, flush=True)
            continue
        if asked is not None and code is None:
            code = asked
    if code is not None:
        hard_exit(code)


def hard_exit(code: int) -> None:
    """Flush stdout and stderr, then end the process at once with ``code`` (``os._exit``:
    no finalization, so no thread can return into a finalizing interpreter)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(code)
