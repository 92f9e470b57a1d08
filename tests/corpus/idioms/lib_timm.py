"""timm's distributed helpers: init_distributed_device, distribute_bn (broadcast and reduce),
reduce_tensor and is_primary (ddpkit_idiomlib.timm_distributed; source:
huggingface/pytorch-image-models, timm/utils/distributed.py, as train.py uses them). Under
CORPUS_INIT=ddpkit, ddpkit.init() takes init_distributed_device's place and the numbers come
from timm's world_info_from_env."""

from __future__ import annotations

import argparse

import torch
from corpus_start import finish, mode
from ddpkit_idiomlib import timm_distributed as timm


def exercise(rank: int, world_size: int) -> None:
    args = argparse.Namespace(rank=rank, local_rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model.train()
    model(torch.arange(12.0).reshape(4, 3) * (rank + 1))  # the running stats now differ by rank
    for reduce in (False, True):
        timm.distribute_bn(model, world_size, reduce=reduce)
        stats = model[1].running_mean.tolist()
        print(f"timm distribute_bn(reduce={reduce}): {[round(v, 4) for v in stats]}")
    loss = torch.tensor(0.5 + rank)
    print(f"timm reduce_tensor: {timm.reduce_tensor(loss, world_size).item():.3f}")
    if timm.is_primary(args):
        print("timm: the primary logs this")
    print(f"timm: local primary {timm.is_primary(args, local=True)}")


def main() -> None:
    args = argparse.Namespace(device="cpu")
    if mode() == "torch":
        device = timm.init_distributed_device(args)
    else:
        import ddpkit

        device = ddpkit.init().device
        args.local_rank, args.rank, args.world_size = timm.world_info_from_env()
        args.distributed = True
    print(f"timm: device {device}, distributed {args.distributed}")
    exercise(args.rank, args.world_size)
    finish()


if __name__ == "__main__":
    main()
