"""transformers' ``TrainingArguments.main_process_first``.

Source: huggingface/transformers, src/transformers/training_args.py
(``TrainingArguments.main_process_first(local=True, desc="work")``), as the examples use it
around ``datasets.map`` (examples/pytorch/text-classification/run_glue.py). The shape: one
``@contextmanager`` with a ``try``/``finally``; the replicas wait at a barrier before the block,
the main process (local or global) calls its barrier in the ``finally`` under
``if is_main_process:``, with debug logging on both sides.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class TrainingArguments:
    """The part of transformers' arguments this idiom reads; the numbers come from torchrun's
    environment, as transformers' ``_setup_devices`` reads them."""

    output_dir: str = "out"
    process_index: int = field(default_factory=lambda: int(os.environ.get("RANK", "0")))
    local_process_index: int = field(default_factory=lambda: int(os.environ.get("LOCAL_RANK", "0")))
    world_size: int = field(default_factory=lambda: int(os.environ.get("WORLD_SIZE", "1")))

    @contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        if self.world_size <= 1:
            yield
            return
        if local:
            is_main_process = self.local_process_index == 0
            main_process_desc = "main local process"
        else:
            is_main_process = self.process_index == 0
            main_process_desc = "main process"
        try:
            if not is_main_process:
                logger.debug(
                    "%d: waiting for the %s to perform %s",
                    self.process_index,
                    main_process_desc,
                    desc,
                )
                dist.barrier()
            yield
        finally:
            if is_main_process:
                logger.debug(
                    "%d: %s completed %s, releasing all replicas",
                    self.process_index,
                    main_process_desc,
                    desc,
                )
                dist.barrier()
