"""tests.support.pids: a process is signalled only while its pid still names it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.support.pids import all_stopped, signal_if_same, start_ticks, wait_until_stopped


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


_THREADS = """
import threading, time
for _ in range(3):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("up", flush=True)
time.sleep(60)
"""


def test_a_stopped_process_is_waited_for_until_every_thread_stopped() -> None:
    child = subprocess.Popen([sys.executable, "-c", _THREADS], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        assert not all_stopped(child.pid)  # running (asleep): not stopped
        child.send_signal(signal.SIGSTOP)
        wait_until_stopped(child.pid)
        assert all_stopped(child.pid)
        child.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while all_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not all_stopped(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not all_stopped(child.pid)  # no such process
