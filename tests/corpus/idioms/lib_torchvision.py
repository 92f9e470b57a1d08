"""torchvision's reference utilities: init_distributed_mode (which replaces builtins.print on
the non-master ranks), reduce_dict, MetricLogger.synchronize_between_processes, all_gather and
save_on_master (ddpkit_idiomlib.torchvision_utils; source: pytorch/vision,
references/detection/utils.py and references/classification/utils.py, as their train.py use
them). Its exercise() runs in never_ddpkit.py, after init_distributed_mode, the script
unchanged under either launcher (the library installed editable), and in all_idioms.py, after
``setup_for_distributed`` under either init, as a user switching to ``ddpkit.init()`` would
keep it (the library installed in site-packages; tests/test_corpus.py)."""

from __future__ import annotations

import torch
from corpus_start import scratch
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
