"""yolov5's ``torch_distributed_zero_first``.

Source: ultralytics/yolov5, utils/torch_utils.py (``torch_distributed_zero_first``, and the
``LOCAL_RANK``/``RANK``/``WORLD_SIZE`` module constants read from torchrun's environment at
import). The shape: a generator context manager whose barrier on the local master comes after
the ``yield`` under ``if local_rank == 0:``, the others' before it, both passing
``device_ids=`` (meant for NCCL; gloo takes it too).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

LOCAL_RANK = int(os.getenv("LOCAL_RANK", "-1"))  # -1: not launched by torchrun
RANK = int(os.getenv("RANK", "-1"))
WORLD_SIZE = int(os.getenv("WORLD_SIZE", "1"))


@contextmanager
def torch_distributed_zero_first(local_rank: int) -> Iterator[None]:
    """Every process waits while each node's local master does the work first (a dataset
    cache, a download)."""
    if local_rank not in (-1, 0):
        dist.barrier(device_ids=[local_rank])
    yield
    if local_rank == 0:
        dist.barrier(device_ids=[0])
