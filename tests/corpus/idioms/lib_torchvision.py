"""torchvision's reference utilities: init_distributed_mode (which replaces builtins.print on
the non-master ranks), reduce_dict, MetricLogger.synchronize_between_processes, all_gather and
save_on_master (ddpkit_idiomlib.torchvision_utils; source: pytorch/vision,
references/detection/utils.py and references/classification/utils.py, as their train.py use
them). Under CORPUS_INIT=ddpkit, ddpkit.init() takes init_distributed_mode's place and the
script does the rest of what it did (its line, setup_for_distributed), as a user switching to
ddpkit would."""

from __future__ import annotations

import argparse

import torch
from corpus_start import finish, mode, scratch
from ddpkit_idiomlib import torchvision_utils as utils


def exercise(rank: int, world_size: int) -> None:
    print("torchvision: only the master prints this")
    print(f"torchvision: rank {rank} prints this with force=True", force=True)  # type: ignore[call-arg]
    metric_logger = utils.MetricLogger(delimiter="  ")
    for step in range(3):
        metric_logger.update(loss=float(rank + step), acc1=torch.tensor(50.0 + 10 * rank))
    metric_logger.synchronize_between_processes()
    print(f"Averaged stats: {metric_logger}")
    losses = {"loss_box": torch.tensor(1.0 + rank), "loss_cls": torch.tensor(2.0 * rank)}
    reduced = utils.reduce_dict(losses)
    summary = ", ".join(f"{name}={value.item():.3f}" for name, value in reduced.items())
    print(f"rank {rank} reduce_dict: {summary}", force=True)  # type: ignore[call-arg]
    gathered = utils.all_gather({"rank": rank, "seen": 10 + rank})
    print(f"rank {rank} all_gather: {gathered}", force=True)  # type: ignore[call-arg]
    path = scratch("torchvision-checkpoint.pth")
    utils.save_on_master({"epoch": 3, "weights": torch.arange(4.0) * (rank + 1)}, path)
    torch.distributed.barrier()
    checkpoint = torch.load(path)
    print(f"rank {rank} loaded {checkpoint['weights'].tolist()}", force=True)  # type: ignore[call-arg]


def main() -> None:
    args = argparse.Namespace(dist_url="env://")
    if mode() == "torch":
        utils.init_distributed_mode(args)
    else:
        import ddpkit

        context = ddpkit.init()
        args.rank, args.world_size, args.distributed = context.rank, context.world_size, True
        print(f"| distributed init (rank {args.rank}): {args.dist_url}", flush=True)
        utils.setup_for_distributed(args.rank == 0)
    exercise(args.rank, args.world_size)
    finish()


if __name__ == "__main__":
    main()
