"""How ``ddpkit run`` prints its workers' output: one rank prefix a line, whole lines, and
progress bars redrawn in place.

torch's agent tees each worker's log file to the terminal (``TailLog``, one thread a stream):
it reads a line and writes ``f"{header}{line}"``. Three things a user sees differently from the
same program under plain ``torchrun`` come from that, and are mended here by
:func:`tail_whole_lines`, which torch's ``TailLog`` calls in place of its own reader (the reach
into torch that installs it is :func:`ddpkit.compat.tee_read_by`):

* torch prefixes lines itself once a process group exists: its excepthook writes
  ``[rank0]: `` before each traceback line, and its C++ log lines read ``[rank0]:[W1201 ...]``.
  Under the default header that gave ``[rank0]: [rank0]: ...``: :func:`once_prefixed` drops
  torch's copy when it repeats the header's rank.
* A worker's ``print`` can reach the file in two writes (its text, then its newline, under
  ``PYTHONUNBUFFERED=1``); torch printed each piece with its own header. A piece is held until
  its line ends (at most :data:`HOLD_PARTIAL_LINE_S`, then printed as it is).
* torch opens the log in text mode, where a lone carriage return ends a line: each redraw of a
  progress bar (``\\r 40%|####``) became a line of its own. Here the file is read with only
  ``\\n`` ending a line; a piece holding a carriage return (a redraw) is printed at once, with
  the header after each carriage return, so the bar is redrawn in place, prefixed. A piece
  printed before its line ended (a redraw, a piece held too long) is continued without a
  second header.

It polls as torch's reader does (``TailLog``'s 0.1 s), but waits on the stop event rather than
sleeping, so that stopping a tee takes no poll's wait.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

__all__ = ["HOLD_PARTIAL_LINE_S", "once_prefixed", "tail_whole_lines"]

# how long a tee'd line read without its end (its writer has not finished it) is held for the
# rest before it is printed as it is, as torch prints it: a progress bar without newlines shows
HOLD_PARTIAL_LINE_S = 1.0

# ddpkit's header, then torch's own prefix of the same rank ("[rank0]: " before a traceback
# line, "[rank0]:" before a C++ log line): torch's copy is dropped
_DOUBLED_PREFIX = re.compile(r"^(\[rank(\d+)\]: )\[rank\2\]: ?")
_LONE_CR = re.compile(r"\r(?!\n|$)")  # a carriage return a redraw follows


def once_prefixed(text: str) -> str:
    """``[rankN]: [rankN]:text`` as ``[rankN]: text``: only a line whose own text starts with
    the header's rank prefix is changed (other templates are left alone)."""
    return _DOUBLED_PREFIX.sub(r"\1", text, count=1)


def prefixed(header: str, text: str, *, continued: bool = False) -> str:
    """``text`` with ``header`` before it and after each carriage return that a redraw
    follows. Not before it when it starts with a redraw (the carriage return would send the
    cursor back over it) or ``continued``: it goes on a line already printed in part."""
    body = _LONE_CR.sub(lambda _: "\r" + header, text)
    return body if continued or _LONE_CR.match(text) else header + body


def tail_whole_lines(  # noqa: PLR0917 (torch's signature, which TailLog.start calls)
    header: str,
    file: str,
    dst: Any,
    finished: Any,
    interval_sec: float,
    log_line_filter: Any = None,
) -> None:
    """torch's ``tail_log.tail_logfile``, printing whole lines and redraws (module docstring).

    The rest is torch's: wait for the file, poll every ``interval_sec``, read to the end once
    ``finished`` is set (here without waiting out a poll); ``log_line_filter`` as torch
    applies it.
    """
    while not os.path.exists(file):
        if finished.is_set():
            return
        finished.wait(interval_sec)

    open_line = False  # the last text printed did not end its line: the next one goes on it

    def emit(text: str) -> None:
        nonlocal open_line
        if log_line_filter and log_line_filter(text):
            dst.write(once_prefixed(prefixed(header, text, continued=open_line)))
            open_line = not text.endswith("\n")

    held, since = "", 0.0
    # newline="\n": only "\n" ends a line (by default a lone "\r" ends one too)
    with open(file, errors="replace", newline="\n") as fp:
        while True:
            piece = fp.readline()
            if piece:
                if not held:
                    since = time.monotonic()
                held += piece
                if held.endswith("\n") or "\r" in held:
                    emit(held)
                    held = ""
                continue
            done = finished.is_set()  # read before the hold is judged: nothing comes after it
            if held and (done or time.monotonic() - since >= HOLD_PARTIAL_LINE_S):
                emit(held)
                held = ""
            if done:
                break
            finished.wait(interval_sec)  # set: the rest is read at once
