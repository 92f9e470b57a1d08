"""Accelerate's main-process-first: rank 0 prepares a cache inside the block, the others then
find it (ddpkit_idiomlib.accelerate_state; source: huggingface/accelerate,
src/accelerate/state.py, PartialState.main_process_first / _goes_first).
Its exercise() runs in all_idioms.py, the library installed (tests/test_corpus.py)."""

from __future__ import annotations

import os

from corpus_start import scratch
from ddpkit_idiomlib.accelerate_state import PartialState


def _prepare_or_read(path: str, rank: int) -> str:
    if not os.path.exists(path):  # the first to get here prepares it
        with open(path, "w") as out:
            out.write(f"prepared by rank {rank}")
    with open(path) as cached:
        return cached.read()


def exercise(rank: int, world_size: int) -> None:
    state = PartialState()
    print(f"accelerate: process {state.process_index} of {state.num_processes}")
    with state.main_process_first():
        text = _prepare_or_read(scratch("accelerate-global"), rank)
    print(f"accelerate main_process_first: {text}")
    with state.local_main_process_first():
        text = _prepare_or_read(scratch("accelerate-local"), rank)
    print(f"accelerate local_main_process_first: {text}")
    state.wait_for_everyone()
    print("accelerate: everyone is here")
