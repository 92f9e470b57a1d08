"""``examples/train.py``'s ``main()`` in ranks forked from the fork server (:mod:`distutil`).

For the tests of the example where the launcher is not what they check (its weights, its
checkpoints, a strategy or precision of its own): forked ranks import torch once (the fork
server's) and form a real gloo group, where a ``ddpkit run`` launch of this short example costs
about as much CPU whatever its length, nearly all of it torch's import in the agent and in each
worker. What a run printed comes back with each line prefixed ``[rankN]: ``, as ``ddpkit run``
shows it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path

import torch

from tests.support.distutil import run_workers, torchrun_env

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0


def _example_rank(rank: int, world_size: int, port: int, argv: list[str]) -> str:
    """Rank ``rank`` of ``examples/train.py argv`` (its ``main()``, in this forked worker, with
    torchrun's variables); what it printed, prefixed."""
    os.environ.update(torchrun_env(rank, world_size, port))  # what ddpkit.init() reads
    # ddpkit run gives its workers OMP_NUM_THREADS=1; torch, imported by the fork server, reads
    # it no more: 3 ranks of 2 threads each on 2 cores would contend at every step
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    sys.argv = ["examples/train.py", *argv]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        example.main()
    return "".join(f"[rank{rank}]: {line}\n" for line in printed.getvalue().splitlines())


def run_example(world_size: int, argv: list[str], timeout_s: float = TIMEOUT_S) -> str:
    """``examples/train.py argv`` in ``world_size`` forked ranks; every rank's output, by rank."""
    return "".join(run_workers(_example_rank, world_size, argv, timeout_s=timeout_s))
