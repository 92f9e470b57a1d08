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


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot, /proc/<pid>/stat's field 22); None when
    no process has that pid. A pid and its start time name one process for good."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # from field 3 (the state) on
    except (OSError, IndexError):
        return None
    return int(fields[19])


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
