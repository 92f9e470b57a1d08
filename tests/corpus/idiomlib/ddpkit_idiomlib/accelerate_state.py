"""Accelerate's main-process-first, as ``PartialState`` shapes it.

Source: huggingface/accelerate, src/accelerate/state.py (``PartialState.wait_for_everyone``,
``_goes_first``, ``main_process_first``, ``local_main_process_first``). The shape that matters:
a plain generator ``_goes_first(is_main)`` that waits at a barrier *before* the block on the
other ranks and *after* it on the main one (``if is_main: self.wait_for_everyone()``), wrapped by
``@contextmanager`` methods through ``yield from``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


class PartialState:
    """The process's place in the job, read from the group (Accelerate reads it at start-up)."""

    def __init__(self) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.num_processes = dist.get_world_size() if distributed else 1
        self.process_index = dist.get_rank() if distributed else 0
        self.local_process_index = int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def wait_for_everyone(self) -> None:
        if self.num_processes > 1:
            dist.barrier()

    def _goes_first(self, is_main: bool) -> Iterator[None]:
        if not is_main:
            self.wait_for_everyone()
        yield
        if is_main:
            self.wait_for_everyone()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        yield from self._goes_first(self.is_main_process)

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        yield from self._goes_first(self.is_local_main_process)
