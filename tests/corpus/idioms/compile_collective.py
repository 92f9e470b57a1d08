"""``torch.compile`` over functions that call a collective: dynamo traces ``dist.all_reduce``
(rewritten to a functional collective) inside the graph; first with the defaults, then with
``fullgraph=True``, where a graph break is an error. The eager backend keeps compilation cheap;
dynamo's tracing is the same. The functions are compiled inside exercise(), so that nothing of
dynamo is imported before the idioms all_idioms.py runs ahead of this one.

Source: pytorch/pytorch, test/distributed/test_inductor_collectives.py (the tests where dynamo
rewrites an in-place ``dist.all_reduce`` inside a compiled function, e.g.
test_dynamo_rewrite_dist_all_reduce), the shape torchtitan-style compiled blocks rely on.
Its exercise() runs in all_idioms.py (tests/test_corpus.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def exercise(rank: int, world_size: int) -> None:
    @torch.compile(backend="eager")
    def averaged(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y / dist.get_world_size()

    @torch.compile(backend="eager", fullgraph=True)
    def scaled_sum(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    for step in range(2):
        print(f"step {step}: averaged {averaged(torch.arange(3.0) * (rank + step)).tolist()}")
    for step in range(2):
        out = scaled_sum(torch.arange(4.0) + rank + step)
        print(f"step {step}: fullgraph {out.tolist()}")
