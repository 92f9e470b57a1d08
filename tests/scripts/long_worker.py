"""Worker for tests/launch/test_run_orphans.py: trains "forever" and says where it is, in files.

Usage: ``long_worker.py DIR [--torch] [--child]``. Each process writes ``DIR/pid.<pid>`` first
thing, then ``DIR/phase.<rank>.<name>`` as it enters each phase: ``start`` (before the slow
imports), ``loop`` (training), ``ckpt`` (a checkpoint write: ``DIR/ckpt.tmp`` written in slow
chunks, then renamed to ``DIR/ckpt-<n>``), back to ``loop``. With ``--torch`` it imports torch
and joins a gloo group (an all_reduce per step); with ``--child`` it also starts a child of its
own (``long_worker.py DIR`` again, which writes its own pid file), as a wrapper command would.
It never ends by itself: whatever stops it is what the test is about.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def phase(where: Path, rank: str, name: str) -> None:
    (where / f"phase.{rank}.{name}").touch()


def checkpoint(where: Path, rank: str, number: int) -> None:
    """A deliberately slow save: 20 chunks 50 ms apart (one second), then the rename."""
    phase(where, rank, "ckpt")
    tmp = where / f"ckpt.{rank}.tmp"
    with tmp.open("wb") as out:
        for _ in range(20):
            out.write(b"x" * 4096)
            out.flush()
            time.sleep(0.05)
    tmp.rename(where / f"ckpt-{rank}-{number}")


def main() -> None:
    where = Path(sys.argv[1])
    (where / f"pid.{os.getpid()}").touch()
    rank = os.environ.get("RANK", "child")
    if "--child" in sys.argv:
        subprocess.Popen([sys.executable, __file__, str(where)])
    phase(where, rank, "start")
    step = None
    if "--torch" in sys.argv:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        step = torch.ones(1)
    phase(where, rank, "loop")
    for number in range(1_000_000):
        if step is not None:
            import torch.distributed as dist

            dist.all_reduce(step)
        time.sleep(0.05)
        if number % 10 == 9:
            checkpoint(where, rank, number)
            phase(where, rank, "loop")


if __name__ == "__main__":
    main()
