"""A plain torch.distributed script that never calls ddpkit (nor reads CORPUS_INIT): under
``ddpkit run`` it must behave as under torchrun.

Source: pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py
(``init_process_group`` from torchrun's environment, DDP, ``destroy_process_group()``), here on
gloo and the CPU. Two warnings every rank prints, as many real scripts do, which both launchers
must show alike: DDP's ``find_unused_parameters=True`` with none unused (the setting detection
codebases default to) makes the reducer log a C++ warning carrying torch's own ``[rankN]:``
prefix, and ``float()`` of a parameter's sum a UserWarning raised from C++.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group(backend="gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)
    for epoch in range(2):
        optimizer.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        weight = round(float(model.module.weight.sum()), 4)
        print(f"epoch {epoch}: loss {loss.item():.4f} weight sum {weight}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
