"""A submission that a stop signal cannot cut in two.

``sbatch`` may have queued a job by the time a Ctrl-C reaches the process that ran it: cut
there, the job runs with no record and its id printed nowhere. So SIGINT and SIGTERM are held
from just before the scheduler is called until the job is recorded (and, on the command line,
its id printed); then the first one held is raised again under the handlers from before.
SLURM's tools run in a session of their own (:func:`ddpkit.cluster.slurmtools.subprocess_runner`),
so a terminal's Ctrl-C reaches only ddpkit. Holds nest.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["HELD_SIGNALS", "held_stop_signals"]

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def held_stop_signals(*, enabled: bool = True) -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block, then raise the first one that came, unless the
    block raised (that exception ends the command anyway, and says why).

    Only the main thread can set handlers: elsewhere, and when not ``enabled`` (a local torchx
    app runs in the foreground and answers a signal itself), this holds nothing. A handler set
    from C (``signal.getsignal`` gives None) cannot be put back, so its signal is not held."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []

    def keep(signum: int, frame: FrameType | None) -> None:
        came.append(signum)

    saved = [(signum, signal.getsignal(signum)) for signum in HELD_SIGNALS]
    saved = [(signum, handler) for signum, handler in saved if handler is not None]
    for signum, _ in saved:
        signal.signal(signum, keep)
    try:
        yield
    finally:
        for signum, handler in saved:
            signal.signal(signum, handler)
    if came:
        signal.raise_signal(came[0])
