"""Feature detection on the collectives by signature: ``"group_src" in
inspect.signature(dist.broadcast).parameters`` and the like, plus the names and docs tools read
(``__name__``, ``__qualname__``, ``__module__``, ``inspect.getdoc``).

Sources: deepseek-ai/DeepEP, tests/utils.py (init_dist: ``"device_id" in
inspect.signature(dist.init_process_group).parameters``), and the same check on
``dist.broadcast`` for ``group_src`` in libraries that support several torch versions.
Its exercise() runs in all_idioms.py (tests/test_corpus.py)."""

from __future__ import annotations

import inspect

import torch.distributed as dist

NAMES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter_tensor",
    "scatter",
)


def exercise(rank: int, world_size: int) -> None:
    for name in NAMES:
        function = getattr(dist, name)
        doc = (inspect.getdoc(function) or "").splitlines()[0]
        print(f"{name}{inspect.signature(function)}")
        print(f"  {function.__name__} {function.__qualname__} {function.__module__}: {doc}")
    print(f"group_src supported: {'group_src' in inspect.signature(dist.broadcast).parameters}")
    device_id = "device_id" in inspect.signature(dist.init_process_group).parameters
    print(f"device_id supported: {device_id}")
