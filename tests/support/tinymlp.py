"""A tiny MLP and a deterministic full-batch step, the same at every world size.

Every step trains on the same 12 rows (divisible by 1, 2, 3, 4 and 6): rank ``r`` of ``W``
takes rows ``r, r + W, ...`` and its loss is its squared errors' sum over 12, times ``W``:
FSDP2 and DDP average the gradients over the ranks, so the step is that of the mean over all
12 rows, whatever the world size. :func:`step` returns that mean (summed over the ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

ROWS = 12


class Block(nn.Module):
    """A residual layer: the unit FSDP2 shards by class in the tests."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


def make_model(width: int = 8, blocks: int = 2) -> nn.Module:
    """The same weights in every process (a fixed seed)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, width), *(Block(width) for _ in range(blocks)), nn.Linear(width, 1)
    )


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 4, generator=generator), torch.randn(ROWS, 1, generator=generator)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> float:
    """One step on this rank's rows; returns the loss over all rows (before the step)."""
    features, targets = data()
    errors = (model(features[rank::world]) - targets[rank::world]).float().pow(2).sum() / ROWS
    (errors * world).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = errors.detach().clone()
    if world > 1:
        dist.all_reduce(total)
    return float(total)


def reference(steps: int) -> list[float]:
    """The losses of an uninterrupted plain run in this process (Adam, lr 0.01)."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return [step(model, optimizer, 0, 1) for _ in range(steps)]
