"""Worker for tests/launch/test_run_orphans.py: trains "forever" and says where it is, in files.

Usage: ``long_worker.py DIR [--torch] [--child] [--teardown]``. Each process writes
``DIR/pid.<pid>`` first thing, then ``DIR/phase.<rank>.<name>`` as it enters each phase:
``start`` (before the slow imports), ``loop`` (training), ``ckpt`` (a checkpoint write:
``DIR/ckpt.tmp`` written in slow chunks, then renamed to ``DIR/ckpt-<n>``), back to ``loop``.
With ``--torch`` it imports torch and joins a gloo group (an all_reduce per step); with
``--child`` it also starts a child of its own (``long_worker.py DIR`` again, which writes its
own pid file), as a wrapper command would.
With ``--teardown`` rank 1 fails (exit 1) once both train, so that the agent tears the group down;
rank 0 answers the agent's SIGTERM (and SIGINT: torch's own parent-death signal for a
``--run-path`` worker) as a script that saves on it does: ``phase.0.term``, then a slow
checkpoint (ten seconds, inside torch's 30 s grace), then exits. Otherwise it never ends by
itself: whatever stops it is what the test is about.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def phase(where: Path, rank: str, name: str) -> None:
    (where / f"phase.{rank}.{name}").touch()


def checkpoint(where: Path, rank: str, number: int, chunks: int = 20) -> None:
    """A deliberately slow save: ``chunks`` chunks 50 ms apart (one second), then the rename."""
    phase(where, rank, "ckpt")
    tmp = where / f"ckpt.{rank}.tmp"
    with tmp.open("wb") as out:
        for _ in range(chunks):
            out.write(b"x" * 4096)
            out.flush()
            time.sleep(0.05)
    tmp.rename(where / f"ckpt-{rank}-{number}")


def on_teardown(where: Path, rank: str) -> None:
    """SIGTERM (the agent stopping the group) or SIGINT: save slowly, then exit."""

    def save_and_exit(signum: int, frame: object) -> None:
        phase(where, rank, "term")
        checkpoint(where, rank, -1, chunks=200)
        os._exit(0)

    signal.signal(signal.SIGTERM, save_and_exit)
    signal.signal(signal.SIGINT, save_and_exit)


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
    if "--teardown" in sys.argv:
        on_teardown(where, rank)
    phase(where, rank, "loop")
    if "--teardown" in sys.argv and rank == "1":
        deadline = time.monotonic() + 120  # rank 0 must be ready for the SIGTERM first
        while not (where / "phase.0.loop").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(1)
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
