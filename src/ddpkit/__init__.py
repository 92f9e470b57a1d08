"""ddpkit: distributed PyTorch training without the boilerplate.

Four calls make a training script distributed, and the same script runs as one process, under
``ddpkit run``, under plain ``torchrun``, inside a SLURM step or under MPI::

    ctx = ddpkit.init()                    # detect the launcher, pick the device, join the group
    model = ddpkit.wrap(model)             # DDP, DataParallel or the plain model
    step = ddpkit.balanced_loss(model, criterion)  # loss = step(x, y): beside each slice under dp
    train = ddpkit.loader(dataset, 32)     # per-rank shards; the epoch advances by itself
    preds = ddpkit.gather(preds)           # in an eval loop: every sample exactly once

In the loop itself: ``accumulate`` (gradient accumulation that skips DDP's sync between
micro-steps), ``clip_grad_norm_`` (the global norm), ``reduce`` / ``Mean`` (metrics across
ranks, the sampler's padding left out) and ``grad_scaler`` (fp16's loss scaler, after
``wrap(model, precision="fp16")``).

``save_checkpoint`` / ``load_checkpoint`` (``async_save_checkpoint`` writes in the
background) and ``preemption_guard`` make it resumable.

Attributes are imported lazily so that ``import ddpkit`` (and ``ddpkit --help``) stay cheap and
never import torch until a runtime function is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "RankInfo": "ddpkit.cluster.rankinfo",
    "detect": "ddpkit.cluster.detect",
    "expand_nodelist": "ddpkit.cluster.nodelist",
    "Context": "ddpkit.worker.context",
    "init": "ddpkit.worker.context",
    "current": "ddpkit.worker.context",
    "shutdown": "ddpkit.worker.context",
    "wrap": "ddpkit.worker.wrap",
    "balanced_loss": "ddpkit.worker.dataparallel",
    "Args": "ddpkit.worker.dataparallel",
    "unwrap": "ddpkit.worker.state_dict",
    "clean_state_dict": "ddpkit.worker.state_dict",
    "load_state_dict": "ddpkit.worker.state_dict",
    "loader": "ddpkit.worker.loader",
    "gather": "ddpkit.worker.gather",
    "accumulate": "ddpkit.worker.accumulate",
    "MicroStep": "ddpkit.worker.accumulate",
    "clip_grad_norm_": "ddpkit.worker.clip",
    "grad_scaler": "ddpkit.worker.precision",
    "reduce": "ddpkit.worker.metrics",
    "Mean": "ddpkit.worker.metrics",
    "save_checkpoint": "ddpkit.worker.checkpoint",
    "load_checkpoint": "ddpkit.worker.checkpoint",
    "async_save_checkpoint": "ddpkit.worker.asyncsave",
    "wait_for_checkpoint": "ddpkit.worker.asyncsave",
    "PendingCheckpoint": "ddpkit.worker.asyncsave",
    "checkpoint_origin": "ddpkit.worker.ckptfiles",
    "preemption_guard": "ddpkit.worker.preempt",
    "PreemptionGuard": "ddpkit.worker.preempt",
    "print": "ddpkit.worker.rankzero",
    "progress": "ddpkit.worker.progress",
    "get_logger": "ddpkit.worker.rankzero",
    "seed_everything": "ddpkit.worker.rankzero",
}

__all__ = [
    "Args",
    "Context",
    "Mean",
    "MicroStep",
    "PendingCheckpoint",
    "PreemptionGuard",
    "RankInfo",
    "__version__",
    "accumulate",
    "async_save_checkpoint",
    "balanced_loss",
    "checkpoint_origin",
    "clean_state_dict",
    "clip_grad_norm_",
    "current",
    "detect",
    "expand_nodelist",
    "gather",
    "get_logger",
    "grad_scaler",
    "init",
    "load_checkpoint",
    "load_state_dict",
    "loader",
    "preemption_guard",
    "print",
    "progress",
    "reduce",
    "save_checkpoint",
    "seed_everything",
    "shutdown",
    "unwrap",
    "wait_for_checkpoint",
    "wrap",
]

if TYPE_CHECKING:
    from ddpkit.cluster.detect import detect
    from ddpkit.cluster.nodelist import expand_nodelist
    from ddpkit.cluster.rankinfo import RankInfo
    from ddpkit.worker.accumulate import MicroStep, accumulate
    from ddpkit.worker.asyncsave import (
        PendingCheckpoint,
        async_save_checkpoint,
        wait_for_checkpoint,
    )
    from ddpkit.worker.checkpoint import load_checkpoint, save_checkpoint
    from ddpkit.worker.ckptfiles import checkpoint_origin
    from ddpkit.worker.clip import clip_grad_norm_
    from ddpkit.worker.context import Context, current, init, shutdown
    from ddpkit.worker.dataparallel import Args, balanced_loss
    from ddpkit.worker.gather import gather
    from ddpkit.worker.loader import loader
    from ddpkit.worker.metrics import Mean, reduce
    from ddpkit.worker.precision import grad_scaler
    from ddpkit.worker.preempt import PreemptionGuard, preemption_guard
    from ddpkit.worker.progress import progress
    from ddpkit.worker.rankzero import get_logger, print, seed_everything
    from ddpkit.worker.state_dict import clean_state_dict, load_state_dict, unwrap
    from ddpkit.worker.wrap import wrap


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
