"""Rank-aware output and seeding: print and log on the main rank only, seed every rank.

Every rank printing everything drowns a job's log (pytorch#117383, torchtitan#4023). These
helpers find the rank from the current ``ddpkit`` context, else from an initialized
``torch.distributed`` group, else from the launcher's environment (``detect()``), so they work
before ``ddpkit.init()`` too. Importing this module does not import torch.
"""

from __future__ import annotations

import builtins
import logging
import os
import random
import sys
from typing import Any

from ddpkit.cluster.detect import detect
from ddpkit.contract import LOG_ALL_RANKS_VAR
from ddpkit.errors import ConfigError

__all__ = ["LOG_ALL_RANKS_VAR", "get_logger", "print", "seed_everything"]

_FORMAT = "[rank %(rank)s] %(levelname)s %(name)s: %(message)s"


def _known_rank() -> int | None:
    """The rank from the ddpkit context or an initialized torch.distributed group, else None."""
    runtime = sys.modules.get("ddpkit.worker.context")
    context = None if runtime is None else runtime.current_or_none()
    if context is not None:
        return int(context.rank)
    # torch.distributed cannot be initialized if nobody imported it: do not import torch here.
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_rank())
    return None


def _rank() -> int:
    known = _known_rank()
    return detect().rank if known is None else known


def print(*args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
    """``builtins.print`` on the main rank (rank 0) only, or on every rank with ``all_ranks``."""
    if all_ranks or _rank() == 0:
        builtins.print(*args, **kwargs)


def _env_all_ranks() -> bool:
    return os.environ.get(LOG_ALL_RANKS_VAR, "").strip().lower() in {"1", "true", "yes", "on"}


def get_logger(name: str = "ddpkit", all_ranks: bool | None = None) -> logging.Logger:
    """A logger that writes ``[rank N] LEVEL name: message`` to stderr on the main rank only.

    With ``all_ranks=True`` (or ``DDPKIT_LOG_ALL_RANKS=1`` when ``all_ranks`` is None) every
    rank writes, at DEBUG level. The logger does not propagate to the root logger (whose
    handlers would print on every rank); calling again reconfigures the same logger.
    """
    every_rank = _env_all_ranks() if all_ranks is None else all_ranks
    logger = logging.getLogger(name)
    handler = next((h for h in logger.handlers if isinstance(h, _RankHandler)), None)
    if handler is None:
        handler = _RankHandler()
        logger.addHandler(handler)
    handler.all_ranks = every_rank
    if every_rank:
        logger.setLevel(logging.DEBUG)
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


class _RankHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr handler that stamps the rank on each record and drops records off the main rank
    unless all ranks log (a handler's filter: records of child loggers are filtered too)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.all_ranks = False
        self._detected: int | None = None  # detect() result, cached: the env does not change
        self.setFormatter(logging.Formatter(_FORMAT))

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _known_rank()
        if rank is None:
            if self._detected is None:
                self._detected = detect().rank
            rank = self._detected
        record.rank = rank
        return (self.all_ranks or rank == 0) and bool(super().filter(record))  # and any added


def seed_everything(seed: int, per_rank: bool = True) -> int:
    """Seed ``random``, NumPy (when installed) and torch; return the seed used.

    With ``per_rank`` the seed is ``seed + rank``, so data augmentation and dropout differ
    between ranks; with ``per_rank=False`` every rank uses ``seed`` (e.g. to build identical
    models without a broadcast).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed={seed!r} is not an int", hint="e.g. seed_everything(42)")
    used = seed + _rank() if per_rank else seed
    if not 0 <= used < 2**32:
        raise ConfigError(
            f"seed={seed} gives {used} on this rank, outside [0, 2**32)",
            hint="NumPy accepts 32-bit seeds only; pick a smaller non-negative seed",
        )
    random.seed(used)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(used)
    import torch

    torch.manual_seed(used)  # also seeds every CUDA device
    return used
