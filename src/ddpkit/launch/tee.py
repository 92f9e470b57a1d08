"""How ``ddpkit run`` prints its workers' output: one rank prefix a line, whole lines, and
progress bars redrawn in place.

torch's ``TailLog`` calls :func:`tail_whole_lines` in place of its own reader (installed by
:func:`ddpkit.compat.tee_read_by`), which mends what differs from plain ``torchrun``:

* torch's own ``[rank0]:`` prefix after the header's is dropped (:func:`once_prefixed`);
* a line written in two pieces is held until it ends (at most :data:`HOLD_PARTIAL_LINE_S`);
* only ``\\n`` ends a line: a redraw (``\\r``) is printed at once, the header after each
  carriage return, so a progress bar is redrawn in place, prefixed;
* ddpkit's ``${pid}`` in the prefix template becomes the process id of the worker writing the
  file (:func:`writer_pid`; ``?`` when it cannot be told, e.g. a worker already gone).

One thread reads every tee'd file of the launch, at torch's pace, instead of one polling
thread a file (``benchmarks/bench_idle.py``).
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

from ddpkit.cluster.stop.forward import child_pids

__all__ = ["HOLD_PARTIAL_LINE_S", "PID_MACRO", "once_prefixed", "tail_whole_lines", "writer_pid"]

# how long a tee'd line read without its end (its writer has not finished it) is held for the
# rest before it is printed as it is, as torch prints it: a progress bar without newlines shows
HOLD_PARTIAL_LINE_S = 1.0

# ddpkit's header, then torch's own prefix of the same rank ("[rank0]: " before a traceback
# line, "[rank0]:" before a C++ log line): torch's copy is dropped
_DOUBLED_PREFIX = re.compile(r"^(\[rank(\d+)\]: )\[rank\2\]: ?")
_LONE_CR = re.compile(r"\r(?!\n|$)")  # a carriage return a redraw follows
PID_MACRO = "${pid}"  # torch's substitution of the prefix template leaves it for ddpkit


def writer_pid(file: str) -> int | None:
    """The child of this process (a worker torch's agent started) whose stdout or stderr is
    ``file``, read from ``/proc``; None where none is (gone, or not Linux)."""
    target = os.path.realpath(file)
    for pid in child_pids(running=True):
        for fd in (1, 2):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return pid
            except OSError:  # ended meanwhile, or not ours to read
                continue
    return None


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
    finished: threading.Event,
    interval_sec: float,
    log_line_filter: Any = None,
) -> None:
    """torch's ``tail_log.tail_logfile``, printing whole lines and redraws (module docstring);
    the file is read by the launch's one reading thread, and this returns once it is read to
    the end after ``finished``."""
    follow = _Follow(header, file, dst, finished, log_line_filter)
    _READER.add(follow, interval_sec)
    finished.wait()  # no polling here: torch sets it when the tee stops
    _READER.wake.set()  # the rest is read now
    follow.drained.wait()
    if follow.error is not None:  # torch logs a tail's error
        raise follow.error


class _Follow:
    """One tee'd file: what was read of it and printed, and whether it is done."""

    def __init__(
        self, header: str, file: str, dst: Any, finished: threading.Event, keep: Any
    ) -> None:
        self.header, self.file, self.dst, self.finished = header, file, dst, finished
        if PID_MACRO in header:  # torch tails a file once its worker runs: look it up now
            pid = writer_pid(file)
            self.header = header if pid is None else header.replace(PID_MACRO, str(pid))
        self.keep = keep
        self.drained = threading.Event()
        self.error: BaseException | None = None
        self._fp: Any = None
        self._held, self._since = "", 0.0
        self._open_line = False  # the last text printed did not end its line

    def step(self) -> bool:
        """Print what the file has now; True once it is done (``finished`` and read to its end)."""
        done = self.finished.is_set()  # read first: what is in the file by then gets printed
        if self._fp is None:
            if not os.path.exists(self.file):
                return done
            # newline="\n": only "\n" ends a line (by default a lone "\r" ends one too)
            self._fp = open(self.file, errors="replace", newline="\n")  # noqa: SIM115
        while piece := self._fp.readline():
            if not self._held:
                self._since = time.monotonic()
            self._held += piece
            if self._held.endswith("\n") or "\r" in self._held:
                self._emit()
        if self._held and (done or time.monotonic() - self._since >= HOLD_PARTIAL_LINE_S):
            self._emit()
        if done:
            self._fp.close()
        return done

    def _emit(self) -> None:
        text, self._held = self._held, ""
        if PID_MACRO in self.header:  # not found at the start: once more, at the first line
            pid = writer_pid(self.file)
            self.header = self.header.replace(PID_MACRO, "?" if pid is None else str(pid))
        if self.keep and self.keep(text):
            self.dst.write(once_prefixed(prefixed(self.header, text, continued=self._open_line)))
            self._open_line = not text.endswith("\n")


class _Reader:
    """The one thread that reads every followed file; it ends when none is left."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.follows: list[_Follow] = []
        self.thread: threading.Thread | None = None

    def add(self, follow: _Follow, interval_s: float) -> None:
        with self.lock:
            self.follows.append(follow)
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, args=(interval_s,), name="ddpkit-tee", daemon=True
                )
                self.thread.start()

    def _run(self, interval_s: float) -> None:
        while True:
            with self.lock:
                follows = list(self.follows)
                if not follows:
                    self.thread = None
                    return
            self.wake.clear()  # a stop from now on ends the wait below at once
            for follow in follows:
                try:
                    finished = follow.step()
                except Exception as error:  # handed to the follow's own thread
                    follow.error, finished = error, True
                if finished:
                    with self.lock:
                        self.follows.remove(follow)
                    follow.drained.set()
            self.wake.wait(interval_s)


_READER = _Reader()
