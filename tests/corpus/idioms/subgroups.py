"""Subgroups: every rank creates every group, in the same order, and keeps its own (the
data-/tensor-parallel layout), then runs collectives on them; ``new_subgroups`` and a group of
one rank too.

Source: NVIDIA/Megatron-LM, megatron/core/parallel_state.py (initialize_model_parallel: a loop
over all the groups' rank lists, ``torch.distributed.new_group(ranks)`` on every rank, the group
kept where ``rank in ranks``); torch.distributed.new_subgroups for the even split.
Its exercise() runs in all_idioms.py (tests/test_corpus.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def exercise(rank: int, world_size: int) -> None:
    mine = None
    for ranks in ([0], [1]):  # one group per rank: every rank makes both
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = group
    assert mine is not None
    everyone = dist.new_group(ranks=list(range(world_size)), backend="gloo")
    print(f"own group: ranks {dist.get_process_group_ranks(mine)}, rank {dist.get_rank(mine)}")

    alone = torch.tensor([float(rank + 1)])
    dist.all_reduce(alone, group=mine)
    together = torch.tensor([float(rank + 1)])
    dist.all_reduce(together, group=everyone)
    print(f"all_reduce alone {alone.item()}, together {together.item()}")

    subgroup, subgroups = dist.new_subgroups(group_size=1)
    value = torch.tensor([float(10 * (rank + 1))])
    dist.broadcast(value, src=rank, group=subgroup)
    print(f"new_subgroups: {len(subgroups)} groups, broadcast {value.item()}")

    source = torch.tensor([float(rank)])
    dist.broadcast(source, group=everyone, group_src=1)
    print(f"broadcast(group_src=1) on the full subgroup: {source.item()}")
    dist.barrier(group=everyone)
