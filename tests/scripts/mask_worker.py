"""Worker for tests/launch/test_run_signal_mask.py: a script that knows nothing of ddpkit and
handles SIGUSR2 itself, late, or not at all.

Usage: ``mask_worker.py DIR MODES SECONDS``; ``MODES`` is one word a rank (``own,never``:
rank 0 ``own``, rank 1 ``never``). Each rank first prints ``mask <rank> <SigBlk has SIGUSR2>
<the same in a child it starts>`` and writes ``DIR/start.<rank>``, then:

* ``own``: installs its own SIGUSR2 handler at once, writes its pid to ``DIR/ready.<rank>``
  and waits (up to SECONDS) for the signal;
* ``late``: the same once ``DIR/go`` exists (its imports, its model: the test says when, so
  that a signal comes before; 60 s at most);
* ``never``: never handles it; sleeps SECONDS once ``DIR/go`` exists (or SECONDS passed
  without it), so that it still runs when the test signals the launcher after ``go``.

Then it prints ``got <rank>`` (its handler ran), ``missed <rank>`` or ``finished <rank>``
(``never``) and exits 0. It imports nothing but the standard library: ddpkit is not in it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# prints whether SIGUSR2 is blocked in the process that runs it
BLOCKED = (
    "import signal; from pathlib import Path; "
    "f = dict(l.partition(':')[::2] for l in Path('/proc/self/status').read_text().splitlines()); "
    "print(bool(int(f['SigBlk'], 16) >> (signal.SIGUSR2 - 1) & 1))"
)


def _blocked_here() -> bool:
    fields = dict(
        line.partition(":")[::2] for line in Path("/proc/self/status").read_text().splitlines()
    )
    return bool(int(fields["SigBlk"], 16) >> (signal.SIGUSR2 - 1) & 1)


if __name__ == "__main__":
    where, modes, seconds = Path(sys.argv[1]), sys.argv[2].split(","), float(sys.argv[3])
    rank = int(os.environ["RANK"])
    mode = modes[rank]
    child = subprocess.run(
        [sys.executable, "-c", BLOCKED], capture_output=True, text=True, check=True
    ).stdout.strip()
    print(f"mask {rank} {_blocked_here()} {child}", flush=True)
    (where / f"start.{rank}").touch()
    if mode != "own":
        deadline = time.monotonic() + (60.0 if mode == "late" else seconds)
        while not (where / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    if mode == "never":
        time.sleep(seconds)
        print(f"finished {rank}", flush=True)
        sys.exit(0)
    got: list[int] = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: got.append(signum))
    (where / f"ready.{rank}.tmp").write_text(str(os.getpid()))
    (where / f"ready.{rank}.tmp").rename(where / f"ready.{rank}")
    deadline = time.monotonic() + seconds
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    print(f"{'got' if got else 'missed'} {rank}", flush=True)
    sys.exit(0)
