"""``ddpkit.wrap(model, compile=True)``: torch.compile in the order that keeps DDP's overlap.

The order: the bare module is compiled (``torch.compile(module, **options)``), then wrapped in
DDP, which is what torch's guide "Where to apply torch.compile?" shows for
DistributedDataParallel. The compiled frames run inside DDP's forward, where torch's
DDPOptimizer (``torch._dynamo.config.optimize_ddp``, on by default) splits the graph at DDP's
bucket boundaries, so each bucket's all-reduce starts while the backward of the next graph runs
(one fused backward would fire every hook at its end: no overlap). The other order,
``torch.compile(DDP(model))``, traces nothing of a model made of torch's own containers
(``nn.Sequential``: dynamo skips DDP's forward and torch.nn's frames under it), and hides
``no_sync`` behind the compiled wrapper. Checkpoints are unaffected either way: ddpkit's state
dicts drop the ``_orig_mod.`` prefix (:mod:`ddpkit.worker.state_dict`).

The pitfalls (pytorch #108966, #109774), and what ddpkit does about each:

- Graph breaks at DDP's buckets are DDPOptimizer's splits, not dynamo's graph breaks, so
  ``fullgraph=True`` still holds for the model's own code; the number of graphs follows
  ``bucket_cap_mb`` (#108966: they cannot be tuned apart). A ``bucket_cap_mb`` under torch's
  first bucket (1 MB) fails in DDPOptimizer at the first forward: ``wrap`` refuses it.
- ``static_graph=True`` (a DDP option) works with it; the tests compare its losses too. Such a
  DDP fails when its first backward skips the sync, compiled or not: ``ddpkit.accumulate``
  syncs that first micro-step.
- BatchNorm's running statistics are buffers: DDP's ``broadcast_buffers`` (on by default)
  copies rank 0's before each forward, outside the compiled graph, as in eager.
  ``SyncBatchNorm`` (``sync_batchnorm=True``, GPUs) breaks the graph (pytorch #161302): it runs
  eagerly inside the compiled forward, so it needs ``fullgraph=False`` (the default).
- DataParallel replicates the module on every forward, which a compiled module does not
  survive: under ``dp`` compile is ignored, with a warning.
- FSDP2 is not this module's order: ``wrap(model, "fsdp", compile=...)`` compiles each block
  in place before sharding it (:mod:`ddpkit.worker.fsdp`).
- Compiling costs seconds to minutes at the first step (and again when shapes change); the
  steps after it are the ones that get faster.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddpkit import compat
from ddpkit.errors import ConfigError
from ddpkit.hints import did_you_mean

__all__ = ["check_buckets", "check_compile", "compiled"]


def check_compile(value: object) -> dict[str, Any] | None:
    """``compile=`` as ``torch.compile``'s keyword arguments; None: no compiling."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"compile={value!r} must be True, False or a dict of torch.compile options",
            hint="e.g. compile=True, or compile={'mode': 'max-autotune'}",
        )
    known = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    for name in value:
        if name not in known:
            raise ConfigError(
                f"compile={{{name!r}: ...}} is not a torch.compile option",
                hint=did_you_mean(
                    str(name), known, hint=f"choose among {', '.join(known)}", cutoff=0.5
                ),
            )
    return dict(value)


def check_buckets(ddp_kwargs: Mapping[str, Any]) -> None:
    """Refuse a DDP ``bucket_cap_mb`` that torch's DDPOptimizer fails on (at the first forward,
    with an assert): one under DDP's first bucket."""
    cap = ddp_kwargs.get("bucket_cap_mb")
    first = compat.first_bucket_bytes()
    if isinstance(cap, int | float) and cap * 1024 * 1024 < first:
        raise ConfigError(
            f"bucket_cap_mb={cap!r} with compile: torch's DDPOptimizer needs buckets of at "
            f"least DDP's first bucket ({first / 2**20:g} MB)",
            hint=f"pass bucket_cap_mb >= {first / 2**20:g}, or compile=False",
        )


def compiled(model: nn.Module, options: Mapping[str, Any], strategy: str) -> nn.Module:
    """``model`` compiled with ``options`` before ``strategy`` wraps it (the module doc says
    why this order); ``model`` itself under ``dp``, with a warning."""
    if strategy == "dp":
        warnings.warn(
            "compile ignored: strategy resolved to 'dp', and DataParallel replicates the "
            "module on every forward, which a compiled module does not survive",
            RuntimeWarning,
            stacklevel=3,
        )
        return model
    result: nn.Module = torch.compile(model, **options)  # type: ignore[assignment]
    return result
