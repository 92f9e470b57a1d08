"""Worker for tests/launch/test_run_signals.py: latches SIGUSR2 late, as a training script's
guard does.

Usage: ``stop_worker.py DIR SECONDS``. Writes ``DIR/start.<rank>`` first thing, ignores SIGUSR1,
waits 0.3 s (its imports), latches SIGUSR2 (``ddpkit.cluster.stop.latch``, what
``preemption_guard()`` does) and "trains" for SECONDS, checking the latch every 10 ms. Then the
ranks agree through files (``end.<rank>.<0|1>``): all exit 75 after printing ``stopped`` when
one saw the signal (before or after its latch; then each ignores SIGTERM and meets the others
again in ``exit.<rank>`` files first, as ``requeue_and_exit`` does), else 0 after
``finished``. No torch: the launcher's windows are what is tested.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    where, seconds = Path(sys.argv[1]), float(sys.argv[2])
    rank = os.environ["RANK"]
    (where / f"start.{rank}").touch()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # USR1 is passed on too: not the stop signal
    time.sleep(0.3)
    from ddpkit.cluster.stop import latch as stopsignal

    stopsignal.latch(signal.SIGUSR2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stopsignal.received(signal.SIGUSR2):
        time.sleep(0.01)
    # agree, as the guard's all_reduce does: both stop when one saw the signal, and exit
    # together (torch's agent stops the other workers once one has exited with non-zero)
    (where / f"end.{rank}.{int(stopsignal.received(signal.SIGUSR2))}").touch()
    while len(list(where.glob("end.*"))) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.005)
    stopped = bool(list(where.glob("end.*.1")))
    if stopped:  # as requeue_and_exit(): torch's agent SIGTERMs the ranks still exiting, so
        # each ignores SIGTERM, then a barrier: none exits before all ignore it (without it, a
        # rank slow to leave the loop above on a loaded machine got the agent's SIGTERM, CI)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (where / f"exit.{rank}").touch()
        while len(list(where.glob("exit.*"))) < int(os.environ["WORLD_SIZE"]):
            time.sleep(0.005)
    print("stopped" if stopped else "finished", flush=True)
    sys.exit(75 if stopped else 0)
