"""A process named by its pid and its start time, so that a test never signals a stranger.

Linux reuses a pid once its process is reaped (pid_max is 32768 here, and the suite starts
thousands of processes, the SLURM tests' beside the others'): a pid printed by a worker, or
written to a file, names another process after that worker ended. A CI run lost an unrelated
test's rank to a clean-up ``os.kill(pid, SIGKILL)`` of such a pid. So a test that may signal a
process after it could have ended records its start time while it surely runs, and signals it
through a pidfd only while the pid still names that process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot, /proc/<pid>/stat's field 22); None when
    no process has that pid. A pid and its start time name one process for good."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return None if fields is None else int(fields[19])


def _stat_fields(path: str) -> list[str] | None:
    """A /proc stat file's fields from the 3rd (the state) on; None when it cannot be read."""
    try:
        with open(path) as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def signal_if_same(pid: int, started: int | None, signum: int = signal.SIGKILL) -> bool:
    """Send ``signum`` to ``pid`` only while it is the process that started at ``started``;
    whether it was sent. Race-free: the pidfd names the process the pid named when it was
    opened, checked after the opening (a process reaped since then is not signalled at all)."""
    if started is None:
        return False
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if start_ticks(pid) != started:
            return False
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signum)
            return True
        return False
    finally:
        os.close(fd)


def all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T in /proc/<pid>/task/*/stat)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    states = [_stat_fields(f"/proc/{pid}/task/{task}/stat") for task in tasks]
    return bool(states) and all(fields is not None and fields[0] in ("T", "t") for fields in states)


def wait_until_stopped(pid: int, timeout_s: float = 30.0) -> None:
    """Return once SIGSTOP (sent before) has stopped every thread of ``pid``.

    A stop is not done when ``kill`` returns: the kernel wakes one thread, and that thread,
    once it runs, stops the others. Until then they run on: on a busy machine a CI run saw a
    stopped store host's server thread answer a client after its SIGSTOP was sent."""
    deadline = time.monotonic() + timeout_s
    while not all_stopped(pid):
        assert time.monotonic() < deadline, f"process {pid} not stopped after {timeout_s:g} s"
        time.sleep(0.005)
