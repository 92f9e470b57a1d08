"""A plain torch.distributed script that never calls ddpkit (nor reads CORPUS_INIT): under
``ddpkit run`` it must behave as under torchrun. It is shaped as torchvision's reference
train.py is, unchanged: it joins with the library's ``init_distributed_mode``
(``init_process_group`` from torchrun's environment, then print silenced on the non-master
ranks unless called with ``force=True``), uses torchvision's utilities (lib_torchvision.py's
exercise), then trains with DDP and ends with ``destroy_process_group()``.

Source: pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py
(``init_process_group`` from torchrun's environment, DDP, ``destroy_process_group()``), here on
gloo and the CPU, and pytorch/vision, references/classification/train.py (init_distributed_mode,
then the utilities; its per-rank lines printed with ``force=True``). Two warnings every rank
prints, as many real scripts do, which both launchers must show alike: DDP's
``find_unused_parameters=True`` with none unused (the setting detection codebases default to)
makes the reducer log a C++ warning carrying torch's own ``[rankN]:`` prefix, and ``float()``
of a parameter's sum a UserWarning raised from C++.

Its job runs with the library installed editable (tests/test_corpus.py). Where a script
replaces init_distributed_mode with ``ddpkit.init()`` (then setup_for_distributed itself),
torchvision's utilities run in all_idioms.py.
"""

from __future__ import annotations

import argparse

import lib_torchvision
import torch
import torch.distributed as dist
from ddpkit_idiomlib import torchvision_utils as utils
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    args = argparse.Namespace(dist_url="env://")
    utils.init_distributed_mode(args)
    rank = args.rank
    lib_torchvision.exercise(rank, args.world_size)
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
        line = f"epoch {epoch}: loss {loss.item():.4f} weight sum {weight}"
        print(line, force=True)  # type: ignore[call-arg]
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
