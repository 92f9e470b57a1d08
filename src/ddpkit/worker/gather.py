"""Exact-once distributed evaluation: every rank's rows of one step, padding removed.

``DistributedSampler`` pads an epoch by repeating samples so every rank gets as many; a naive
all-gather then counts those samples twice (pytorch#25162, accelerate#575). It also interleaves:
rank r's j-th sample is position ``j * W + r`` of the (shuffled) epoch, so concatenating the
ranks' rows and cutting the tail would drop real samples and keep duplicates. ``gather``
interleaves the gathered rows back into position order and cuts only positions
``>= len(dataset)`` (see :class:`ddpkit.worker.loader.ShardLayout`).
"""

from __future__ import annotations

import zlib
from typing import Any, TypeVar, cast, overload

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker.context import Context, current
from ddpkit.worker.loader import ShardLayout, active_step

__all__ = ["comm_device", "gather"]

T = TypeVar("T")


@overload
def gather(x: torch.Tensor) -> torch.Tensor: ...
@overload
def gather(x: list[T] | tuple[T, ...]) -> list[T]: ...
def gather(x: Any) -> Any:
    """All ranks' rows of the current step of a ``ddpkit.loader`` loop, in sampler order.

    Call it on every rank, once per batch (several times per batch is fine, e.g. predictions
    and labels), with one row per sample of the batch: a tensor (rows = first dimension,
    same trailing shape and dtype on every rank) or a list of picklable objects. Over an
    epoch every sample appears exactly once, in dataset order when ``shuffle=False``. At
    world size 1, ``x`` comes back unchanged (a tuple as a list), after the same checks.
    """
    context = current()
    found = active_step()
    if found is None:
        raise UsageError(
            "ddpkit.gather() was called outside a loop over a ddpkit.loader",
            hint="call it inside `for batch in ddpkit.loader(...)`, once per batch, so it "
            "knows which samples of the epoch the rows belong to",
        )
    owner, step = found
    layout = owner.layout
    _check_rows(x, layout, step)
    if isinstance(x, torch.Tensor):
        return x if context.world_size == 1 else _gather_tensor(x, context, layout, step)
    if context.world_size == 1:
        return x if isinstance(x, list) else list(x)
    return _gather_objects(list(x), context, layout, step)


def _check_rows(x: object, layout: ShardLayout, step: int) -> None:
    if isinstance(x, torch.Tensor):
        got = int(x.shape[0]) if x.dim() > 0 else None
    elif isinstance(x, list | tuple):
        got = len(x)
    else:
        raise ConfigError(
            f"gather(x) got x of type {type(x).__name__}",
            hint="pass a tensor with one row per sample, or a list with one item per sample",
        )
    expected = layout.rows(step)
    if got != expected:
        shown = "a 0-d tensor" if got is None else f"{got}"
        raise ConfigError(
            f"gather expected {expected} rows for step {step} of the epoch, got {shown}",
            hint="gather per-sample values (one row per sample of the batch), all_reduce "
            "scalars such as a batch's mean loss",
        )


def comm_device(
    backend: str, context_device: torch.device, tensor_device: torch.device
) -> torch.device:
    """Where the all-gather runs: NCCL needs the rank's GPU, gloo works on the CPU."""
    if ":" in backend:  # e.g. "cpu:gloo,cuda:nccl": one backend per device type
        served = {part.split(":", 1)[0].strip() for part in backend.split(",")}
        return tensor_device if tensor_device.type in served else context_device
    if backend == "nccl":
        return context_device
    if backend == "gloo":
        return torch.device("cpu")
    return tensor_device


def _check_same_signature(local: torch.Tensor, world_size: int) -> None:
    # Gloo aborts the whole process on mismatched sizes; a tiny collective first turns that
    # into an error naming every rank's shape.
    signature = [zlib.crc32(str(local.dtype).encode()), zlib.crc32(repr(local.shape[1:]).encode())]
    mine = torch.tensor(signature, dtype=torch.int64, device=local.device)
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(parts, mine)
    if all(torch.equal(part, parts[0]) for part in parts):
        return
    shapes: list[object] = [None] * world_size
    dist.all_gather_object(shapes, (tuple(local.shape), str(local.dtype)))
    raise ConfigError(
        "gather(x) got tensors of different trailing shape or dtype on different ranks: "
        + ", ".join(f"rank {rank}: {shape}" for rank, shape in enumerate(shapes)),
        hint="every rank must gather rows of the same shape and dtype; pad variable-length "
        "rows to a common length first",
    )


def _gather_tensor(
    x: torch.Tensor, context: Context, layout: ShardLayout, step: int
) -> torch.Tensor:
    local = x.detach().to(comm_device(context.backend, context.device, x.device)).contiguous()
    _check_same_signature(local, context.world_size)
    parts = [torch.empty_like(local) for _ in range(context.world_size)]
    dist.all_gather(parts, local)
    # (rows, W, ...) → row j of rank r lands at j * W + r: the sampler's position order.
    merged = torch.stack(parts, dim=1).reshape(-1, *local.shape[1:])
    return merged[: layout.real_rows(step)].to(x.device)


def _gather_objects(x: list[T], context: Context, layout: ShardLayout, step: int) -> list[T]:
    parts: list[object] = [None] * context.world_size
    dist.all_gather_object(parts, x)
    ranks = cast(list[list[T]], parts)  # every rank sent a list of len(x) items
    merged = [ranks[rank][row] for row in range(len(x)) for rank in range(context.world_size)]
    return merged[: layout.real_rows(step)]
