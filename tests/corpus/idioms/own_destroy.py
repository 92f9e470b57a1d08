"""The script destroys the process group itself at the end, then works on alone.

Source: pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py
(``destroy_process_group()`` as the last line of ``main``), the shape of torch's DDP tutorials.
Its exercise() runs last in all_idioms.py (tests/test_corpus.py): it ends that script's group,
as the tutorial's last line does, so nothing runs after it but the script's solo work and exit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exercise(rank: int, world_size: int) -> None:
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"total {total.item()}")
    dist.destroy_process_group()
    print(f"after destroy_process_group: initialized {dist.is_initialized()}")
    print(f"solo work after the group: {sum(range(10))}")
