"""tests.support.pids: a process is signalled only while its pid still names it."""

from __future__ import annotations

import signal
import subprocess

from tests.support.pids import signal_if_same, start_ticks


def test_a_pid_is_signalled_only_while_it_names_the_process_that_was_recorded() -> None:
    first = subprocess.Popen(["sleep", "30"])
    try:
        ticks = start_ticks(first.pid)
        assert ticks is not None and ticks > 0
        # another start time stands for a process that got the pid later: never signalled
        assert not signal_if_same(first.pid, ticks + 1) and first.poll() is None
        assert not signal_if_same(first.pid, None) and first.poll() is None
        assert signal_if_same(first.pid, ticks, signal.SIGTERM)
        assert first.wait(timeout=10) == -signal.SIGTERM
        assert start_ticks(first.pid) is None  # reaped: no process has the pid
        assert not signal_if_same(first.pid, ticks)
    finally:
        first.kill()
        first.wait()
