"""transformers' main-process-first around dataset preprocessing, local and global
(ddpkit_idiomlib.transformers_args; source: huggingface/transformers,
src/transformers/training_args.py, TrainingArguments.main_process_first, as
examples/pytorch/text-classification/run_glue.py uses it).
Its exercise() runs in all_idioms.py, the library installed (tests/test_corpus.py)."""

from __future__ import annotations

import logging
import os

from corpus_start import scratch
from ddpkit_idiomlib.transformers_args import TrainingArguments


def _map_or_load(path: str, rank: int) -> str:
    if not os.path.exists(path):  # datasets.map writes its cache file once
        with open(path, "w") as out:
            out.write(f"tokenized by rank {rank}")
    with open(path) as cached:
        return cached.read()


def exercise(rank: int, world_size: int) -> None:
    logging.basicConfig(level=logging.INFO)  # the examples' setting: the debug lines stay quiet
    args = TrainingArguments()
    for local in (True, False):
        with args.main_process_first(local=local, desc="dataset map pre-processing"):
            text = _map_or_load(scratch(f"transformers-{local}"), rank)
        print(f"transformers main_process_first(local={local}): {text}")
