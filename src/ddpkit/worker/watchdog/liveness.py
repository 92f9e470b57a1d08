"""Is the training thread blocked? Samples of its innermost frame and its context switches.

A thread blocked in a collective (or a device sync) keeps the same innermost frame at the same
instruction and, on Linux, makes no voluntary context switch; a loop of short sleeps or waits
keeps switching. Only a thread blocked for the whole bound lets the watchdog end a rank.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable

# --- the training thread: blocked or not ---------------------------------------------------------

_SWITCHES = re.compile(rb"^voluntary_ctxt_switches:\s*(\d+)", re.MULTILINE)


def _voluntary_switches(native_id: int | None) -> int | None:
    """How often thread ``native_id`` of this process went to sleep (Linux), else None."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/status", "rb") as status:
            match = _SWITCHES.search(status.read())
    except OSError:
        return None
    return int(match.group(1)) if match else None


class Progress:
    """Samples a thread; ``blocked_since`` is when its signature last changed.

    The signature: innermost frame (id), code, instruction offset, and on Linux the thread's
    voluntary context switches. No reference to the frame is kept (its locals may be large).
    """

    def __init__(self, thread: threading.Thread, clock: Callable[[], float]) -> None:
        self._thread = thread
        self._last: tuple[int, int, int, int | None] | None = None
        self.blocked_since = clock()

    def sample(self, now: float) -> None:
        signature = self._signature()
        if signature is None or signature != self._last:
            self.blocked_since = now
        self._last = signature

    def _signature(self) -> tuple[int, int, int, int | None] | None:
        thread = self._thread
        if thread.ident is None or not thread.is_alive():  # the program's main code is done
            return None
        frame = sys._current_frames().get(thread.ident)
        if frame is None:
            return None
        signature = (id(frame), id(frame.f_code), frame.f_lasti)
        del frame
        return (*signature, _voluntary_switches(thread.native_id))
