"""timm's distributed helpers: init_distributed_device, distribute_bn (broadcast and reduce),
reduce_tensor and is_primary (ddpkit_idiomlib.timm_distributed; source:
huggingface/pytorch-image-models, timm/utils/distributed.py, as train.py uses them). Under
CORPUS_INIT=ddpkit, ddpkit.init() takes init_distributed_device's place and the numbers come
from timm's world_info_from_env.

Its script (main) is also where the two plain idioms that change what a later idiom would meet
run, as a training script of this shape has them: the script's own signal handlers
(own_signals.py: SIGTERM's installed before the library's init, SIGUSR1's after, both received
and kept), then one rank's ``sys.exit(3)`` after the job's last collective (exit_three.py),
which ends the job with rank 1's exit code 3 while rank 0 ends normally. Neither changes what
timm's helpers compute or print. One launch under each launcher instead of one for them and
one for timm's (a pair of launches is 5-12 s of CPU, mostly torch's import). Its exercise()
also runs in all_idioms.py (tests/test_corpus.py)."""

from __future__ import annotations

import argparse
import sys

import exit_three
import own_signals
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


def main() -> int:
    print("--- own_signals", flush=True)
    own_signals.before_group()
    args = argparse.Namespace(device="cpu")
    if mode() == "torch":
        device = timm.init_distributed_device(args)
    else:
        import ddpkit

        device = ddpkit.init().device
        args.local_rank, args.rank, args.world_size = timm.world_info_from_env()
        args.distributed = True
    own_signals.exercise(args.rank, args.world_size)
    print("--- lib_timm", flush=True)
    print(f"timm: device {device}, distributed {args.distributed}")
    exercise(args.rank, args.world_size)
    print("--- exit_three", flush=True)
    code = exit_three.exercise(args.rank, args.world_size)
    if code == 0:
        finish()
    return code


if __name__ == "__main__":
    sys.exit(main())
