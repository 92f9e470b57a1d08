"""ddpkit: distributed PyTorch training without the boilerplate.

Four calls make a training script distributed, and the same script runs as one process, under
``ddpkit run``, under plain ``torchrun``, inside a SLURM step or under MPI::

    ctx = ddpkit.init()                    # detect the launcher, pick the device, join the group
    model = ddpkit.wrap(model)             # DDP, DataParallel or the plain model
    train = ddpkit.loader(dataset, 32)     # per-rank shards; the epoch advances by itself
    preds = ddpkit.gather(preds)           # in an eval loop: every sample exactly once

``save_checkpoint`` / ``load_checkpoint`` and ``preemption_guard`` make it resumable.

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
    "Context": "ddpkit.runtime",
    "init": "ddpkit.runtime",
    "current": "ddpkit.runtime",
    "shutdown": "ddpkit.runtime",
    "wrap": "ddpkit.launch.wrap",
    "loader": "ddpkit.launch.data",
    "gather": "ddpkit.launch.gather",
    "save_checkpoint": "ddpkit.checkpoint",
    "load_checkpoint": "ddpkit.checkpoint",
    "preemption_guard": "ddpkit.preempt",
    "PreemptionGuard": "ddpkit.preempt",
    "print": "ddpkit.rankzero",
    "get_logger": "ddpkit.rankzero",
    "seed_everything": "ddpkit.rankzero",
}

__all__ = [
    "Context",
    "PreemptionGuard",
    "RankInfo",
    "__version__",
    "current",
    "detect",
    "expand_nodelist",
    "gather",
    "get_logger",
    "init",
    "load_checkpoint",
    "loader",
    "preemption_guard",
    "print",
    "save_checkpoint",
    "seed_everything",
    "shutdown",
    "wrap",
]

if TYPE_CHECKING:
    from ddpkit.checkpoint import load_checkpoint, save_checkpoint
    from ddpkit.cluster.detect import detect
    from ddpkit.cluster.nodelist import expand_nodelist
    from ddpkit.cluster.rankinfo import RankInfo
    from ddpkit.launch.data import loader
    from ddpkit.launch.gather import gather
    from ddpkit.launch.wrap import wrap
    from ddpkit.preempt import PreemptionGuard, preemption_guard
    from ddpkit.rankzero import get_logger, print, seed_everything
    from ddpkit.runtime import Context, current, init, shutdown


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
