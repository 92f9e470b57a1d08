"""The report of a finished launch: how it ended and, for a failure, its root cause.

It replaces torch's ``ChildFailedError`` box, which shows a documentation link where the
traceback should be (without ``@record``) and orders failures by whole-second timestamps.
"""

from __future__ import annotations

import os
import re
import signal
import socket
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.api import LogsDest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ddpkit.cluster.stop.signals import EXIT_STOPPED
from ddpkit.compat import recorded_traceback
from ddpkit.contract import HANG_REPORT_FILE

__all__ = ["LaunchOutcome", "WorkerFailure", "attempt_dir", "failed_outcome"]

_TRACEBACK_HEAD = "Traceback (most recent call last):"
# a script that does not compile: no traceback header, its file and line, then the error
_FILE_LINE = re.compile(r'\s*File ".*", line \d+\s*$')
_COMPILE_ERROR = re.compile(r"(SyntaxError|IndentationError|TabError)\b")
_TRACEBACK_MAX_LINES = 60
_LOG_TAIL_BYTES = 256 * 1024


@dataclass(frozen=True)
class WorkerFailure:
    """One failed worker. ``exit_code`` is the raw code: negative N means killed by signal N."""

    rank: int
    local_rank: int
    host: str
    pid: int
    exit_code: int
    signal: str | None = None
    traceback: str | None = None
    source: str | None = None  # the error file or stderr log the traceback was read from
    stderr_log: str | None = None

    @property
    def shell_exit_code(self) -> int:
        """The code a shell would show: the worker's own code, 128 + N for signal N, else 1."""
        if self.exit_code > 0:
            return self.exit_code
        return 128 - self.exit_code if self.exit_code < 0 else 1

    @property
    def shell_signal(self) -> str | None:
        """The signal a code of 128 + N stands for: how a shell (a ``--no-python`` wrapper,
        ``sh -c "python train.py; ..."``) reports a child that signal N killed."""
        return _signal_name(self.exit_code - 128) if self.signal is None else None

    @property
    def died_of(self) -> str | None:
        """The signal that ended the worker, or its training process under a shell."""
        return self.signal or self.shell_signal

    def headline(self) -> str:
        how = f"exit code {self.exit_code}"
        if self.signal is not None:
            how = f"signal {self.signal} (exit code {self.shell_exit_code})"
        elif self.shell_signal is not None:
            how += f" (128 + {self.exit_code - 128}: {self.shell_signal}, as a shell reports it)"
        return f"rank {self.rank} (local rank {self.local_rank}) on {self.host}: {how}"


@dataclass(frozen=True)
class LaunchOutcome:
    """How a launch ended. ``exit_code`` follows the root cause (0: every worker succeeded)."""

    exit_code: int
    root_cause: WorkerFailure | None = None
    other_failures: tuple[WorkerFailure, ...] = ()
    interrupted_by: str | None = None  # the signal that stopped the agent itself
    log_dir: str | None = None

    def describe(self) -> str:
        """A short report for the console (the CLI prints it to stderr on failure)."""
        if self.interrupted_by is not None:
            return f"ddpkit: interrupted by {self.interrupted_by}; the workers were stopped"
        if self.root_cause is None:
            return "ddpkit: all workers finished"
        root = self.root_cause
        every = (root, *self.other_failures)
        if all(failure.exit_code == EXIT_STOPPED for failure in every):
            return (
                f"ddpkit: the workers stopped early with a checkpoint (exit code {EXIT_STOPPED}, "
                "e.g. after a stop signal outside SLURM); run the same command again to resume"
            )
        lines = [f"ddpkit: worker failed (root cause): {root.headline()}"]
        hung = _hang_report(self.log_dir)
        if hung is not None and not root.traceback:  # ended at the report (its action: end)
            path, text = hung
            lines.append(f"ddpkit: the job hung; the hang watchdog's report (from {path}):")
            lines += ["  " + line for line in text.splitlines()]
        elif root.traceback:
            lines.append(f"ddpkit: traceback of rank {root.rank} (from {root.source}):")
            lines += ["  " + line for line in root.traceback.splitlines()]
            if hung is not None:  # reported earlier, the job going on (its action: report)
                lines.append(f"ddpkit: the hang watchdog reported a hang earlier: {hung[0]}")
        elif root.died_of is not None:
            lines += _killed(root)
        else:
            lines.append(f"ddpkit: no traceback: {_why_no_traceback(root)}")
        lines += [f"ddpkit: also stopped: {other.headline()}" for other in self.other_failures]
        if self.log_dir:
            lines.append(f"ddpkit: worker logs: {self.log_dir}")
        return "\n".join(lines)


# What usually sends each signal; only SIGKILL may be the OOM killer (it sends nothing else).
_SIGNAL_CAUSES = {
    "SIGKILL": "from outside: possibly the OOM killer (check `dmesg` for 'Out of memory' or "
    "'oom-kill'), or a kill -9",
    "SIGABRT": "abort(): a failed assertion or an uncaught C++ exception in native code "
    "(torch, CUDA, NCCL, an extension)",
    "SIGSEGV": "a segmentation fault in native code (torch, CUDA, an extension)",
    "SIGBUS": "a bus error: often a full /dev/shm (DataLoader workers share tensors there) or "
    "a memory-mapped file that shrank",
    "SIGFPE": "an arithmetic fault in native code",
    "SIGILL": "an illegal instruction: native code built for another CPU",
    "SIGTERM": "sent from outside (a time limit, scancel, kill) or by torch's agent",
    "SIGINT": "an interrupt (Ctrl-C) or sent from outside",
}
_FAULTS = ("SIGABRT", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL")
_STDERR_TAIL_LINES = 10


def _killed(failure: WorkerFailure) -> list[str]:
    """Lines for a worker a signal ended: the signal, its usual cause, the worker's stderr."""
    name = failure.died_of or "a signal"
    cause = _SIGNAL_CAUSES.get(name, "sent from outside, or by the worker itself")
    lines = [f"ddpkit: no traceback: rank {failure.rank} died of {name}, {cause}"]
    if name in _FAULTS:
        lines.append(
            "ddpkit: with PYTHONFAULTHANDLER=1 in its environment, Python prints every "
            "thread's stack to stderr on such a fault"
        )
    if not failure.stderr_log:
        lines.append(
            "ddpkit: its stderr went to the console only (ddpkit keeps it in a file unless "
            "--tee/--redirects leave stderr out)"
        )
        return lines
    tail = [line.rstrip() for line in _last_lines(failure.stderr_log) if line.strip()]
    if not tail:
        return [*lines, f"ddpkit: its stderr ({failure.stderr_log}) is empty"]
    lines.append(f"ddpkit: last lines of its stderr ({failure.stderr_log}):")
    return lines + ["  " + line for line in tail[-_STDERR_TAIL_LINES:]]


def _signal_name(number: int) -> str | None:
    """``SIGSEGV`` for 11; None for what is no signal (real-time ones have no name either)."""
    try:
        return signal.Signals(number).name if number > 0 else None
    except ValueError:
        return None


def _hang_report(log_dir: str | None) -> tuple[str, str] | None:
    """The hang watchdog's report a worker left in the attempt's log folder, if any."""
    if not log_dir:
        return None
    path = os.path.join(log_dir, HANG_REPORT_FILE)
    try:
        with open(path, encoding="utf-8", errors="replace") as report:
            text = report.read(_LOG_TAIL_BYTES).rstrip()
    except OSError:
        return None
    return (path, text) if text else None


def _last_lines(path: str) -> list[str]:
    """The lines of a log's last 256 KiB, or [] when unreadable."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, os.path.getsize(path) - _LOG_TAIL_BYTES))
            return log.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def _why_no_traceback(failure: WorkerFailure) -> str:
    if failure.stderr_log:
        return f"the worker exited without raising (see {failure.stderr_log})"
    return (
        "its stderr was not captured; keep --tee/--redirects on stderr (the default), or decorate "
        "its entry point with torch.distributed.elastic.multiprocessing.errors.record"
    )


def failed_outcome(exc: ChildFailedError, logs: LogsDest | None) -> LaunchOutcome:
    host = socket.gethostname()
    ordered = sorted(exc.failures.items(), key=lambda item: _root_cause_key(item[0], item[1], logs))
    failures = [_worker_failure(rank, failure, host, logs) for rank, failure in ordered]
    root = failures[0]
    return LaunchOutcome(root.shell_exit_code, root, tuple(failures[1:]), log_dir=attempt_dir(logs))


def _root_cause_key(
    rank: int, failure: ProcessFailure, logs: LogsDest | None
) -> tuple[int, float, int]:
    """Sort key: the first worker to fail is the root cause. Workers not killed by SIGTERM
    (torch's shutdown) first, then by when they last wrote their error file or stderr log
    (sub-second, where torch's timestamps are whole seconds), then rank. An empty log tells
    nothing (its mtime is the attempt's start): its worker sorts at the end of the second
    torch saw it fail in."""
    killed_by_shutdown = int(failure.exitcode == -signal.SIGTERM)
    for path in (failure.error_file, _stderr_log(failure.local_rank, logs)):
        if path and os.path.isfile(path) and os.path.getsize(path) > 0:
            return killed_by_shutdown, os.path.getmtime(path), rank
    return killed_by_shutdown, float(failure.timestamp) + 1.0, rank


def _worker_failure(
    rank: int, failure: ProcessFailure, host: str, logs: LogsDest | None
) -> WorkerFailure:
    stderr_log = _stderr_log(failure.local_rank, logs)
    traceback, source = recorded_traceback(failure), failure.error_file
    # a signal ends a process without a traceback: one in its log is an earlier, handled one
    # (also under a shell, which exits 128 + the signal's number)
    signalled = failure.exitcode < 0 or _signal_name(failure.exitcode - 128) is not None
    if traceback is None and stderr_log and not signalled:
        traceback, source = _traceback_from_log(stderr_log), stderr_log
    return WorkerFailure(
        rank=rank,
        local_rank=failure.local_rank,
        host=host,
        pid=failure.pid,
        exit_code=failure.exitcode,
        signal=failure.signal_name() if failure.exitcode < 0 else None,
        traceback=traceback,
        source=source if traceback else None,
        stderr_log=stderr_log,
    )


def _stderr_log(local_rank: int, logs: LogsDest | None) -> str | None:
    path = logs.stderrs.get(local_rank) if logs is not None else None
    return path if path and path != os.devnull else None  # "" means the console


def _traceback_from_log(path: str) -> str | None:
    """The last ``Traceback (most recent call last):`` block of a worker's stderr log.

    Lines carry whatever prefix the worker printed before the header (torch's excepthook writes
    ``[rankN]: `` after ``init_process_group``); it is stripped.
    """
    lines = _last_lines(path)
    starts = [i for i, line in enumerate(lines) if _TRACEBACK_HEAD in line]
    if not starts:
        return _compile_error(lines)
    prefix = lines[starts[-1]].split(_TRACEBACK_HEAD, 1)[0]
    block = [line.removeprefix(prefix) for line in lines[starts[-1] :]]
    while block and not block[-1].strip():
        block.pop()
    if len(block) > _TRACEBACK_MAX_LINES:
        skipped = len(block) - _TRACEBACK_MAX_LINES
        block = [block[0], f"  ... ({skipped} lines skipped)", *block[-_TRACEBACK_MAX_LINES + 2 :]]
    return "\n".join(block)


def _compile_error(lines: list[str]) -> str | None:
    """The report Python prints, without a traceback header, when the script itself does not
    compile: its ``File "...", line N`` line to the ``SyntaxError`` (or subclass) line, when
    those end the log."""
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    if not lines or not _COMPILE_ERROR.match(lines[-1]):
        return None
    for i in range(len(lines) - 2, max(-1, len(lines) - 8), -1):
        if _FILE_LINE.match(lines[i]):
            return "\n".join(lines[i:])
    return None


def attempt_dir(logs: LogsDest | None) -> str | None:
    """``<log_dir>/<run_id>_<random>/attempt_<n>`` (torch's DefaultLogsSpecs layout)."""
    if logs is None or not logs.error_files:
        return None
    first = next(iter(logs.error_files.values()))
    return os.path.dirname(os.path.dirname(first)) if first != os.devnull else None
