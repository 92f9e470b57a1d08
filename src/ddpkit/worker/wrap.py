"""One call that wraps a model for the job at hand: DDP, DataParallel, FSDP2 or the plain model.

``"auto"`` (the pure :func:`resolve_strategy`) picks DDP when the world has more than one
process, DataParallel when one process sees several GPUs, and the plain model otherwise, so the
same script runs under a launcher, on one multi-GPU machine or on a laptop. DataParallel is
ddpkit's (:mod:`ddpkit.worker.dataparallel`). ``"fsdp"`` (:mod:`ddpkit.worker.fsdp`) is never
picked by ``"auto"``: a sharded model's checkpoints and memory are the user's choice. A model
whose parts are on several devices is never moved (:mod:`ddpkit.worker.placement`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import ConfigError
from ddpkit.hints import did_you_mean
from ddpkit.worker.compiling import check_buckets, check_compile, compiled
from ddpkit.worker.context import Context, current
from ddpkit.worker.dataparallel import DataParallel
from ddpkit.worker.fsdp import check_blocks, fsdp_policy, is_sharded, shard_model
from ddpkit.worker.placement import Placement, plan_placement
from ddpkit.worker.precision import apply_precision, check_precision
from ddpkit.worker.straggler import TIMES
from ddpkit.worker.structure import split_sizes

__all__ = ["STRATEGIES", "resolve_strategy", "wrap"]

STRATEGIES: tuple[str, ...] = ("auto", "ddp", "dp", "fsdp", "single")

# Keyword arguments DistributedDataParallel accepts besides the module itself.
_DDP_OPTIONS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self",
    "module",
}


def resolve_strategy(strategy: str, *, world_size: int, device_type: str, device_count: int) -> str:
    """The concrete strategy (``ddp``, ``dp`` or ``single``) for ``strategy`` in this job.

    ``device_count`` is the number of GPUs this process sees (0 without CUDA).
    """
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"strategy={strategy!r} is not a known strategy",
            hint=did_you_mean(str(strategy), STRATEGIES, cutoff=0.5),
        )
    if strategy == "dp" and world_size > 1:
        raise ConfigError(
            f"strategy='dp' with world_size={world_size}: DataParallel does not synchronize "
            "gradients between processes",
            hint="use strategy='ddp' (or 'auto') when a launcher starts several processes",
        )
    if strategy == "dp" and (device_type != "cuda" or device_count == 0):
        return "single"  # the same script on a machine without GPUs; wrap warns
    if strategy != "auto":
        return strategy
    if world_size > 1:
        return "ddp"
    if device_type == "cuda" and device_count > 1:
        return "dp"
    return "single"


def wrap(
    model: nn.Module,
    strategy: str = "auto",
    *,
    sync_batchnorm: bool = False,
    first_device_batch: int | None = None,
    fsdp_blocks: Any = None,
    precision: str | None = None,
    compile: bool | Mapping[str, Any] = False,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it for ``strategy``; needs ``ddpkit.init()``.

    ``ddp_kwargs`` go to ``DistributedDataParallel`` (``device_ids`` defaults to this rank's
    GPU). With ``strategy="auto"`` they are ignored when auto does not pick DDP, so one script
    serves every world size; with an explicit ``"dp"``/``"single"`` they are an error.
    ``sync_batchnorm=True`` converts BatchNorm layers to ``SyncBatchNorm``; that only means
    something under DDP on GPUs (batch statistics synchronized across processes): the other
    strategies, and DDP on CPU (which torch refuses), ignore it with a warning.
    ``first_device_batch``: under ``dp``, at most that many samples of each batch on the
    first GPU (the output device); ignored by the other strategies.
    ``fsdp_blocks`` (module classes, or None for a size rule) configures ``strategy="fsdp"``
    (:mod:`ddpkit.worker.fsdp`) and is an error with any other strategy.
    A model with parts on several devices keeps its placement (see
    :mod:`ddpkit.worker.placement`).

    ``precision``: ``"bf16"``, ``"fp16"`` or None (float32): the forward runs under autocast
    and returns float32 outputs; under ``"fp16"`` step through :func:`ddpkit.grad_scaler`
    (see :mod:`ddpkit.worker.precision`). Under ``"fsdp"`` the same switch is FSDP2's own
    ``MixedPrecisionPolicy`` instead (``"bf16"``: bfloat16 parameters in compute, float32
    gradient reduction; ``"fp16"`` needs a sharded scaler ddpkit does not have: an error).
    ``compile``: True, or a dict of ``torch.compile`` keyword arguments: the bare module is
    compiled, then wrapped, so that under DDP torch's DDPOptimizer splits the graph at DDP's
    buckets (see :mod:`ddpkit.worker.compiling`); under ``"fsdp"`` each block is compiled in
    place before ``fully_shard`` (see :mod:`ddpkit.worker.fsdp`).
    """
    context = current()
    if isinstance(model, DistributedDataParallel | nn.DataParallel) or is_sharded(model):
        raise ConfigError(
            f"model is already wrapped in {type(model).__name__}",
            hint="pass the bare nn.Module to ddpkit.wrap",
        )
    visible = torch.cuda.device_count() if context.device.type == "cuda" else 0
    chosen = resolve_strategy(
        strategy,
        world_size=context.world_size,
        device_type=context.device.type,
        device_count=visible,
    )
    _check_ddp_kwargs(ddp_kwargs, strategy, chosen)
    blocks = check_blocks(fsdp_blocks)
    _check_fsdp_options(fsdp_blocks, chosen)
    if chosen == "fsdp":
        policy = fsdp_policy(precision)
    else:
        autocast_dtype = check_precision(precision, context.device.type)
    compile_options = check_compile(compile)
    if compile_options is not None and chosen == "ddp":
        check_buckets(ddp_kwargs)
    split_sizes(1, 1, first=first_device_batch)  # a bad value fails in every mode, not on GPUs only
    if strategy == "dp" and chosen == "single":
        warnings.warn(
            f"strategy='dp' on {context.device.type} without GPUs: running as 'single' (the "
            "same script uses DataParallel where several GPUs are visible)",
            RuntimeWarning,
            stacklevel=2,
        )
    devices = {str(tensor.device) for tensor in [*model.parameters(), *model.buffers()]}
    placement = plan_placement(
        devices, requested=strategy, chosen=chosen, ddp_options=list(ddp_kwargs)
    )
    chosen = placement.strategy
    if placement.move:
        model = model.to(context.device)
    if chosen == "fsdp":
        if sync_batchnorm:
            raise ConfigError(
                "sync_batchnorm=True with strategy='fsdp'",
                hint="convert the model yourself (nn.SyncBatchNorm.convert_sync_batchnorm) "
                "before wrap, or drop sync_batchnorm",
            )
        return shard_model(model, blocks, policy, compile_options)
    if chosen == "ddp":
        model = _sync_batchnorm(model, context, sync_batchnorm)
    model = apply_precision(model, autocast_dtype, context.device.type)
    if compile_options is not None:
        model = compiled(model, compile_options, chosen)
    if chosen == "ddp":
        return _wrap_ddp(model, context, ddp_kwargs, placement)
    if sync_batchnorm:
        warnings.warn(
            f"sync_batchnorm=True ignored: strategy resolved to {chosen!r}, and SyncBatchNorm "
            "only synchronizes across DDP processes",
            RuntimeWarning,
            stacklevel=2,
        )
    if chosen == "dp":
        return DataParallel(model, first_device_batch=first_device_batch)
    return model


def _check_ddp_kwargs(ddp_kwargs: dict[str, Any], strategy: str, chosen: str) -> None:
    for name, value in ddp_kwargs.items():
        if name not in _DDP_OPTIONS:
            raise ConfigError(
                f"{name}={value!r} is not a DistributedDataParallel option",
                hint=did_you_mean(name, sorted(_DDP_OPTIONS), cutoff=0.5),
            )
    if ddp_kwargs and chosen != "ddp" and strategy != "auto":
        # (under "fsdp" too: fully_shard takes none of DDP's options)
        raise ConfigError(
            f"DDP options {sorted(ddp_kwargs)} given with strategy={strategy!r}",
            hint="they only apply to strategy='ddp' or 'auto'; drop them or change strategy",
        )


def _check_fsdp_options(blocks: object, chosen: str) -> None:
    if blocks is not None and chosen != "fsdp":
        raise ConfigError(
            f"fsdp_blocks={blocks!r} given, but the strategy resolved to {chosen!r}",
            hint="it only applies to strategy='fsdp' (which 'auto' never picks): pass "
            "strategy='fsdp', or drop it",
        )


def _sync_batchnorm(model: nn.Module, context: Context, sync_batchnorm: bool) -> nn.Module:
    if sync_batchnorm and context.device.type == "cpu":
        # DDP raises for SyncBatchNorm in CPU modules; keep the same script usable on a laptop.
        warnings.warn(
            "sync_batchnorm=True ignored on cpu: DDP supports SyncBatchNorm only for GPU "
            "modules, so BatchNorm keeps per-rank statistics",
            RuntimeWarning,
            stacklevel=3,
        )
    elif sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
    return model


def _wrap_ddp(
    model: nn.Module, context: Context, ddp_kwargs: dict[str, Any], placement: Placement
) -> nn.Module:
    options = dict(ddp_kwargs)
    if placement.ddp_device_ids is None:
        options["device_ids"] = None  # a module on several GPUs (torch's rule)
    elif context.device.type == "cuda":
        options.setdefault("device_ids", [context.device.index])
    wrapped = DistributedDataParallel(model, **options)
    TIMES.watch_model(wrapped)  # its sampled compute times feed the straggler report
    return wrapped
