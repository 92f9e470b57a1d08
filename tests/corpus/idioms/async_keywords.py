"""Collectives called with keywords and ``async_op=True``: the returned work is waited on, its
future chained, and point-to-point ``isend``/``irecv`` requests waited on.

Sources: pytorch/tutorials, intermediate_source/dist_tuto.rst (``req = dist.isend(tensor=...,
dst=1)``, ``req.wait()``); pytorch/pytorch, torch/distributed/algorithms/ddp_comm_hooks/
default_hooks.py (``dist.all_reduce(tensor, group=group_to_use, async_op=True).get_future()``
then ``.then(...)``).
Its exercise() runs in all_idioms.py (tests/test_corpus.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def exercise(rank: int, world_size: int) -> None:
    tensor = torch.full((3,), float(rank + 1))
    work = dist.all_reduce(
        tensor=tensor, op=dist.ReduceOp.SUM, group=dist.group.WORLD, async_op=True
    )
    work.wait()
    print(f"all_reduce(async_op=True): {tensor.tolist()}")

    halved = (
        dist.all_reduce(torch.full((2,), float(rank)), async_op=True)
        .get_future()
        .then(lambda fut: fut.value()[0] / world_size)
        .wait()
    )
    print(f"get_future().then(...): {halved.tolist()}")

    source = torch.tensor([10.0 * (rank + 1)])
    dist.broadcast(tensor=source, src=0, async_op=True).wait()
    print(f"broadcast(tensor=..., src=0): {source.tolist()}")

    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(tensor_list=gathered, tensor=torch.tensor([float(rank)]), async_op=True).wait()
    print(f"all_gather(tensor_list=..., tensor=...): {[t.item() for t in gathered]}")

    dist.barrier(async_op=True).wait()
    if rank == 0:
        request = dist.isend(tensor=torch.tensor([42.0]), dst=1)
    else:
        box = torch.zeros(1)
        request = dist.irecv(tensor=box, src=0)
    request.wait()
    print("isend/irecv waited" if rank == 0 else f"irecv got {box.item()}")
