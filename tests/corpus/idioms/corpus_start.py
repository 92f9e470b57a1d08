"""How a corpus script joins and leaves its job, chosen by ``CORPUS_INIT`` (set by
tests/test_corpus.py): ``torch`` joins with plain ``init_process_group("gloo")`` and ends with
``destroy_process_group()``, as torch's documentation asks; ``ddpkit`` joins with
``ddpkit.init()``, every default on, and leaves the group to ddpkit, which destroys it at exit.
Not an idiom itself: the helper every idiom script but ``never_ddpkit.py`` starts with."""

from __future__ import annotations

import os

import torch.distributed as dist

MODES = ("torch", "ddpkit")


def mode() -> str:
    value = os.environ.get("CORPUS_INIT", "")
    if value not in MODES:
        raise SystemExit(f"CORPUS_INIT must be one of {MODES}, not {value!r}")
    return value


def start() -> tuple[int, int]:
    """Join the job; (rank, world size)."""
    if mode() == "ddpkit":
        import ddpkit

        ddpkit.init()
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def finish() -> None:
    if mode() == "torch":
        dist.destroy_process_group()


def scratch(name: str) -> str:
    """A path in the folder the test gave this launch (shared by its ranks)."""
    return os.path.join(os.environ["CORPUS_TMP"], name)
