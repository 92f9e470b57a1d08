"""The script's own SIGUSR1 and SIGTERM handlers: a SIGTERM handler installed before the group
is up (graceful shutdown), a SIGUSR1 handler after it (SLURM's warning before the time limit,
``--signal=USR1@90``); each rank then receives both signals and its own handlers must run, and
stay installed.

Source: Lightning-AI/pytorch-lightning, src/lightning/pytorch/trainer/connectors/
signal_connector.py (SIGUSR1 for SLURM requeue, SIGTERM noted for a graceful stop, handlers set
with ``signal.signal`` once the trainer is set up; ``_has_already_handler``: a SIGUSR1 handler
found there already keeps Lightning from setting its requeue handler), the shape most
SLURM-aware scripts copy.
Its before_group() and exercise() run in lib_timm.py's script (tests/test_corpus.py).
"""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

import torch
import torch.distributed as dist

received: list[str] = []


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    received.append("SIGTERM")


def on_sigusr1(signum: int, frame: FrameType | None) -> None:
    received.append("SIGUSR1")


def wait_for(count: int) -> None:
    deadline = time.monotonic() + 10
    while len(received) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def has_already_handler(signum: signal.Signals) -> bool:
    return signal.getsignal(signum) not in (None, signal.SIG_DFL)


def before_group() -> None:
    """The graceful-shutdown handler, installed before the script joins its group."""
    print(f"SIGTERM handled before ours: {has_already_handler(signal.SIGTERM)}")
    signal.signal(signal.SIGTERM, on_sigterm)


def exercise(rank: int, world_size: int) -> None:
    print(f"SIGUSR1 handled before ours: {has_already_handler(signal.SIGUSR1)}")
    signal.signal(signal.SIGUSR1, on_sigusr1)
    dist.barrier()
    for number, sig in enumerate((signal.SIGUSR1, signal.SIGTERM), start=1):
        os.kill(os.getpid(), sig)
        wait_for(number)
    print(f"rank {rank} handled {received}")
    ours = [signal.getsignal(signal.SIGTERM) is on_sigterm]
    ours.append(signal.getsignal(signal.SIGUSR1) is on_sigusr1)
    print(f"rank {rank} handlers still ours: {ours}")
    count = torch.tensor(float(len(received)))
    dist.all_reduce(count)
    print(f"signals handled in the job: {int(count.item())}")
