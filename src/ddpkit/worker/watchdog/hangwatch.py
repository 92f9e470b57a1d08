"""The hang watchdog's moving part: the first rank whose collective (:mod:`.flight`) passes the
bound claims the report, asks every rank for its piece over the store, and publishes the report
(:func:`.hang.report`). A rank whose threads cannot run (the GIL held) sends no piece: a
gatherer on its host sends it :data:`STACKS_SIGNAL`, and ``faulthandler`` writes its stacks."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

from ddpkit.contract import HANG_REPORT_FILE, LOG_DIR_VAR
from ddpkit.worker.watchdog.flight import DEFAULT_GROUP, Flight
from ddpkit.worker.watchdog.hang import HangBounds, is_program, rank_zero_if, report, short_path
from ddpkit.worker.watchdog.store import StoreLink

# Ignored by default, and sent by nobody else in practice (out-of-band data, to who asked for it)
STACKS_SIGNAL = signal.SIGURG
_SIGNALLED = 64  # silent ranks asked for their stacks, at most
_LOADER = os.path.join("torch", "utils", "data", "")


class HangWatch:
    """One rank's hang watchdog: :meth:`check` each interval; the link asks :meth:`piece`."""

    def __init__(self, link: StoreLink, flight: Flight, bounds: HangBounds) -> None:
        self._link, self.flight, self.bounds = link, flight, bounds
        self._main, self._clock = threading.current_thread(), link.clock
        self._report_paths = report_paths(os.environ)
        self._claimed = False
        self.done = False  # a report was made and the job goes on: no other one this run
        self.without_rank0 = False  # this rank gathered and rank 0 did not answer: it prints
        link.piece = self.piece

    def gather_s(self) -> float:
        """How long the gatherer waits for the pieces: every rank polls once a beat interval."""
        return max(3.0, 3 * self._link.beat_interval_s + 1.0)

    def piece(self) -> dict[str, Any]:
        """This rank's answer: host, pid, main thread's stack, its collectives (the oldest in
        flight, at the program's innermost frame; the last ones), its rank-0-only ``if``."""
        running, done = self.flight.calls()
        stack = _stack(self._main)
        program = [[short_path(f), line, fn, code] for f, line, fn, code in stack if is_program(f)]
        at = program[-1] if program else None
        under = None
        if running is not None:
            running["site"] = f"{at[0]}:{at[1]}" if at else "an unknown place"
            if running["group"] == DEFAULT_GROUP:  # a subgroup's rank 0 may call with peers
                with contextlib.suppress(Exception):
                    under = rank_zero_if(stack)
        loader = None
        if any(_LOADER in str(row[0]) for row in stack):
            with contextlib.suppress(Exception):
                pids = [str(child.pid) for child in multiprocessing.active_children()]
                loader = ", ".join(pids) or "none alive"
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "stack": stack,
            "at": at,
            "running": running,
            "last": done[-1] if done else None,
            "tail": done[:-1],
            "loader": loader,
            "under": under,
        }

    def check(self, now: float) -> str | None:
        """The report when this rank must act on it now (it saw or made one), else None."""
        if self.done:
            return None
        if self._link.hang_report is not None:
            return self._link.hang_report
        if self._claimed:
            return None
        waiting = self.flight.waiting(now)
        if waiting is None or waiting[0] < self.bounds.step_s:
            return None
        for again in (False, True):  # again before a report: retired since, the status behind?
            self.flight.look(now, again=again)
            waiting = self.flight.waiting(now)
            if waiting is None:
                return None
            waited_s, patient = waiting
            past = self.flight.past_first_step and not patient
            if waited_s < self.bounds.bound(past):
                return None
        self._claimed = True
        if not self._link.call(self._link.claim_hang):
            return None  # another rank gathers; its report comes through the store
        link = self._link
        deadline = self._clock() + self.gather_s()
        while self._clock() < deadline and (self._link.call(link.answered) or 0) < link.world_size:
            time.sleep(0.1)
        pieces = self._link.call(link.pieces) or {}
        self.without_rank0 = 0 not in pieces
        silent = [rank for rank in range(link.world_size) if rank not in pieces]
        notes = {rank: self._stacks_of(rank) for rank in silent[:_SIGNALLED]}
        text = report(
            pieces, link.world_size, waited_s, self.bounds.which(past), link.rank, silent=notes
        )
        self._link.call(lambda: link.publish_report(text))
        return text

    def _stacks_of(self, rank: int) -> str:
        """Have a silent rank on this host write its threads' stacks; what the report says."""
        host, pid, _ = self._link.call(lambda: self._link.who(rank)) or (None, None, None)
        name = STACKS_SIGNAL.name
        if not host or not pid:
            return ""
        if host != socket.gethostname():
            return f"; `kill -{name[3:]} {pid}` on {host} writes its threads' stacks to its stderr"
        try:
            os.kill(pid, STACKS_SIGNAL)
        except OSError as error:
            return f"; {name} to pid {pid} failed ({error.strerror})"
        return f"; sent {name}: faulthandler writes its threads' stacks to its stderr (pid {pid})"

    def write(self, text: str) -> list[str]:
        """The report in this rank's log folders, whole (through a rename); the paths."""
        written = []
        for path in self._report_paths:
            partial = f"{path}.{os.getpid()}.partial"
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(partial, "w", encoding="utf-8") as out:
                    out.write(text + "\n")
                os.replace(partial, path)
                written.append(path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(partial)
        return written


_REGISTERED: list[bool] = []


def stacks_on_signal() -> bool:
    """``faulthandler`` writes the threads' stacks on :data:`STACKS_SIGNAL` (its C handler runs
    while a thread holds the GIL), unless something else handles it; whether it registered."""
    if not _REGISTERED and signal.getsignal(STACKS_SIGNAL) is signal.SIG_DFL:
        with contextlib.suppress(RuntimeError, ValueError, OSError, AttributeError):  # no stderr
            faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
            _REGISTERED.append(True)
    return bool(_REGISTERED)


def stacks_off() -> None:
    """Undo :func:`stacks_on_signal` (the signal's former handling comes back)."""
    if _REGISTERED:
        _REGISTERED.clear()
        with contextlib.suppress(Exception):
            faulthandler.unregister(STACKS_SIGNAL)


def report_paths(env: Mapping[str, str]) -> list[str]:
    """Where the report goes besides stderr: the attempt's log folder under ``ddpkit run`` (and
    torchrun), where the launcher's summary finds it; ``DDPKIT_LOG_DIR``, by SLURM job."""
    paths = []
    error_file = env.get("TORCHELASTIC_ERROR_FILE", "")
    if error_file and os.path.isabs(error_file):
        paths.append(os.path.join(os.path.dirname(os.path.dirname(error_file)), HANG_REPORT_FILE))
    log_dir = env.get(LOG_DIR_VAR, "")
    if log_dir and os.path.isabs(log_dir):
        stem, suffix = os.path.splitext(HANG_REPORT_FILE)
        job = env.get("SLURM_JOB_ID", "").strip()
        paths.append(
            os.path.join(log_dir, f"{stem}-{job}{suffix}" if job.isdigit() else HANG_REPORT_FILE)
        )
    return paths


def _stack(thread: threading.Thread) -> list[list[Any]]:
    """The thread's stack as [file, line, function, code] rows, outermost first, ours left out."""
    frame = sys._current_frames().get(thread.ident or -1)
    summary = traceback.extract_stack(frame) if frame is not None else []
    del frame
    here = os.path.dirname(os.path.abspath(__file__))
    return [
        [entry.filename, entry.lineno, entry.name, (entry.line or "").strip()]
        for entry in summary
        if not entry.filename.startswith(here)
    ]
