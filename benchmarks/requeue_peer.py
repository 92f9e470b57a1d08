"""The peer of ``bench_requeue.py``: submitit's own preemption path, on the same payload.

A ``submitit.helpers.Checkpointable`` that trains what examples/train.py trains (the same
data, model, optimizer, batch size, steps and step delay, 2 nodes x 1 process over gloo) with
plain torch: ``TorchDistributedEnvironment`` for the ranks, DistributedDataParallel made before
the checkpoint loads (as examples/train.py wraps first), ``torch.save`` every few steps on rank
0. On SIGUSR2 submitit calls :meth:`Train.checkpoint` on rank 0 (in its signal handler): it
saves the current state, and submitit pickles the returned resubmission and runs ``scontrol
requeue``. The requeued run loads the newest checkpoint and prints "resumed from", as
examples/train.py does, right before its next step. The data and the model are written out
here, not imported from examples/train.py: that module imports ddpkit, whose import time the
plain-torch side must not pay.

Imported by the job's tasks (the bench puts this folder on their PYTHONPATH), so that submitit
pickles the class by reference.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import submitit

# the live training state of this process (never pickled with the resubmission)
_LIVE: dict[str, Any] = {}


def _save(ck: Path, step: int) -> Path:
    import torch

    path = ck / f"ckpt-{step:08d}.pt"
    state = {"model": _LIVE["model"].state_dict(), "optimizer": _LIVE["optimizer"].state_dict()}
    torch.save({**state, "step": step}, path)
    return path


class Train(submitit.helpers.Checkpointable):
    def __init__(self, ck: str, epochs: int, train_size: int, every: int, delay: float) -> None:
        self.ck, self.epochs, self.train_size = ck, epochs, train_size
        self.every, self.delay = every, delay

    def __call__(self) -> int:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        submitit.helpers.TorchDistributedEnvironment().export()
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if rank == 0:
            print(f"submitit: world size {dist.get_world_size()}", flush=True)
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1234)
        centres = torch.randn(4, 32, generator=gen) * 2.0
        gen = torch.Generator().manual_seed(1)
        labels = torch.randint(0, 4, (self.train_size,), generator=gen)
        features = centres[labels] + torch.randn(self.train_size, 32, generator=gen) * 4.0
        data = TensorDataset(features, labels)
        sampler = DistributedSampler(data, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=64, sampler=sampler)
        model = nn.Sequential(
            nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4)
        )
        ddp = DistributedDataParallel(model)  # before the resume, as examples/train.py wraps
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ck = Path(self.ck)
        found = sorted(ck.glob("ckpt-*.pt"))
        step = 0
        if found:
            state = torch.load(found[-1], map_location="cpu")
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = int(state["step"])
            if rank == 0:
                print(f"resumed from {found[-1]} at step {step}", flush=True)
        _LIVE.update(model=model, optimizer=optimizer, step=step)
        per_epoch = len(loader)
        loss_fn = nn.CrossEntropyLoss()
        for epoch in range(step // per_epoch, self.epochs):
            sampler.set_epoch(epoch)
            for index, (x, y) in enumerate(loader):
                if epoch * per_epoch + index < step:
                    continue  # done before the requeue
                optimizer.zero_grad(set_to_none=True)
                loss_fn(ddp(x), y).backward()
                optimizer.step()
                step += 1
                _LIVE["step"] = step
                if rank == 0 and step % self.every == 0:
                    _save(ck, step)
                time.sleep(self.delay)
        dist.destroy_process_group()
        return step

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """submitit's preemption hook (rank 0, in its SIGUSR2 handler): save, then resubmit."""
        if "model" in _LIVE:
            _save(Path(self.ck), _LIVE["step"])
            print("stop signal: saved", flush=True)
        return super().checkpoint(*args, **kwargs)  # type: ignore[no-any-return]
