"""A DataLoader whose worker processes are forked after the group is up: a
``DistributedSampler`` shards the data, ``set_epoch`` reshuffles each epoch, two workers per
rank started with ``fork`` (Linux's default), and the epoch's sum is all-reduced.

Source: pytorch/examples, imagenet/main.py (DistributedSampler, ``num_workers=args.workers``,
``train_sampler.set_epoch(epoch)``, the loader built after ``init_process_group``).
Its exercise() runs in all_idioms.py (tests/test_corpus.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(float(index * index))


def exercise(rank: int, world_size: int) -> None:
    sampler = DistributedSampler(Squares(), shuffle=True, seed=7)
    loader = DataLoader(
        Squares(), batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context="fork"
    )
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = torch.cat([batch for batch in loader])
        total = seen.sum()
        dist.all_reduce(total)
        print(f"epoch {epoch}: rank {rank} saw {sorted(int(v) for v in seen)[:4]}...")
        print(f"epoch {epoch}: all ranks {int(total.item())}")
