"""Exact-once distributed evaluation: every rank's rows of one step, padding removed.

``DistributedSampler`` pads an epoch by repeating samples, so a naive all-gather counts them
twice (pytorch#25162, accelerate#575), and it interleaves: rank r's j-th sample is position
``j * W + r``. ``gather`` puts the gathered rows back into position order and cuts only
positions ``>= len(dataset)`` (:class:`ddpkit.worker.loader.ShardLayout`).

Gloo aborts every process when ranks all-gather tensors of different sizes, so ranks agree on
the trailing shape and dtype first: the first gather at each place of a step in a pass with a
tiny collective of its own, later ones inside the data collective (a 16-byte header of each
rank's signature, rows of the agreed size), so a rank whose rows changed shape gets an error
naming every rank's shape instead of an abort, at the cost of one collective a step.
"""

from __future__ import annotations

import functools
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar, cast, overload

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker.context import Context, current
from ddpkit.worker.loader import ShardLayout, active_pass

__all__ = ["comm_device", "gather"]

T = TypeVar("T")


@dataclass
class GatherMemo:
    """What ``gather`` has agreed with the other ranks during one pass: the same on every rank,
    because every rank makes the same calls in the same order (SPMD). ``calls`` counts the
    gathers of step ``step``; ``agreed[i]`` is the (dtype, trailing shape) that the i-th gather
    of a step had on every rank when last checked."""

    step: int = -1
    calls: int = 0
    agreed: dict[int, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)

    def ordinal(self, step: int) -> int:
        """The index of this gather among the calls of ``step`` (counting it)."""
        if step != self.step:
            self.step, self.calls = step, 0
        self.calls += 1
        return self.calls - 1


# each live loader pass's memo, dropped with the pass
_MEMOS: weakref.WeakKeyDictionary[object, GatherMemo] = weakref.WeakKeyDictionary()


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
    found = active_pass()
    if found is None:
        raise UsageError(
            "ddpkit.gather() was called outside a loop over a ddpkit.loader",
            hint="call it inside `for batch in ddpkit.loader(...)`, once per batch, so it "
            "knows which samples of the epoch the rows belong to",
        )
    layout, step = found.loader.layout, found.step
    _check_rows(x, layout, step)
    if isinstance(x, torch.Tensor):
        if context.world_size == 1:
            return x
        return _gather_tensor(x, context, layout, step, _MEMOS.setdefault(found, GatherMemo()))
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


_HEADER_BYTES = 16  # two int64: the crc32 of the dtype's name and of the trailing shape


@functools.lru_cache(maxsize=256)
def _header(dtype: torch.dtype, trailing: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The 16 bytes announcing a signature, cached (collectives only read it)."""
    codes = [zlib.crc32(str(dtype).encode()), zlib.crc32(repr(torch.Size(trailing)).encode())]
    return torch.tensor(codes, dtype=torch.int64, device=device).view(torch.uint8)


def _raise_shape_mismatch(local: torch.Tensor, world_size: int) -> NoReturn:
    shapes: list[object] = [None] * world_size
    dist.all_gather_object(shapes, (tuple(local.shape), str(local.dtype)))
    raise ConfigError(
        "gather(x) got tensors of different trailing shape or dtype on different ranks: "
        + ", ".join(f"rank {rank}: {shape}" for rank, shape in enumerate(shapes)),
        hint="every rank must gather rows of the same shape and dtype; pad variable-length "
        "rows to a common length first",
    )


def _check_same_signature(local: torch.Tensor, world_size: int) -> None:
    # Gloo aborts the whole process on mismatched sizes; a tiny collective first turns that
    # into an error naming every rank's shape.
    mine = _header(local.dtype, tuple(local.shape[1:]), local.device)
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(parts, mine)
    if not all(torch.equal(part, parts[0]) for part in parts):
        _raise_shape_mismatch(local, world_size)


def _all_gather_flat(buffer: torch.Tensor, world_size: int, backend: str) -> torch.Tensor:
    """Every rank's 1-d ``buffer`` as the rows of one (W, n) tensor: gathered into one flat
    tensor on gloo and NCCL (no list of W outputs to allocate), as a list elsewhere."""
    if all(name in ("gloo", "nccl") for name in _backend_names(backend)):
        out = buffer.new_empty(world_size * buffer.numel())
        # torch 2.13 deprecates all_gather_into_tensor (a FutureWarning in the user's output)
        # for all_gather_single; the torch versions before it have only the former
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, buffer)
        return out.view(world_size, -1)
    parts = [torch.empty_like(buffer) for _ in range(world_size)]
    dist.all_gather(parts, buffer)
    return torch.stack(parts)


@functools.lru_cache(maxsize=16)
def _backend_names(backend: str) -> tuple[str, ...]:
    """``"gloo"`` -> ("gloo",); ``"cpu:gloo,cuda:nccl"`` -> ("gloo", "nccl")."""
    return tuple(part.rsplit(":", 1)[-1].strip() for part in backend.split(","))


def _gather_with_header(
    local: torch.Tensor, agreed: tuple[torch.dtype, tuple[int, ...]], world_size: int, backend: str
) -> torch.Tensor | None:
    """One collective: a header and rows of the agreed size from every rank. Every rank's rows
    as (W, rows, ...), or None when every rank sent the same new signature; raises the shape
    error when ranks differ."""
    dtype, trailing = agreed
    rows = int(local.shape[0])
    mine = (local.dtype, tuple(local.shape[1:]))
    header = _header(*mine, local.device)
    if mine == agreed:
        payload = local.reshape(-1).view(torch.uint8)
    else:  # send the size everyone expects; the header tells them why it is zeros
        numel = rows * int(torch.Size(trailing).numel())
        payload = torch.zeros(numel * dtype.itemsize, dtype=torch.uint8, device=local.device)
    gathered = _all_gather_flat(torch.cat([header, payload]), world_size, backend)
    headers = gathered[:, :_HEADER_BYTES]
    expected = _header(dtype, trailing, local.device)
    if torch.equal(headers, expected.expand(world_size, -1)):
        # row stride 16 + rows x item size bytes: the byte view of each row's payload is
        # aligned for ``dtype`` (16 is a multiple of every item size)
        return gathered[:, _HEADER_BYTES:].view(dtype).reshape(world_size, rows, *trailing)
    if torch.equal(headers, headers[:1].expand(world_size, -1)):
        return None  # every rank changed alike: a new signature they all share
    _raise_shape_mismatch(local, world_size)


def _gather_parts(
    local: torch.Tensor, context: Context, memo: GatherMemo, step: int
) -> torch.Tensor:
    world_size = context.world_size
    ordinal = memo.ordinal(step)
    mine = (local.dtype, tuple(local.shape[1:]))
    agreed = memo.agreed.get(ordinal)
    if agreed is not None:
        parts = _gather_with_header(local, agreed, world_size, context.backend)
        if parts is not None:
            return parts
        # every rank's header said: this same new signature; gather it plainly
    else:
        _check_same_signature(local, world_size)  # a collective of its own, before the gather
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    memo.agreed[ordinal] = mine
    return torch.stack(gathered)


def _gather_tensor(
    x: torch.Tensor, context: Context, layout: ShardLayout, step: int, memo: GatherMemo
) -> torch.Tensor:
    local = x.detach().to(comm_device(context.backend, context.device, x.device)).contiguous()
    parts = _gather_parts(local, context, memo, step)
    # (W, rows, ...) → row j of rank r lands at j * W + r: the sampler's position order.
    merged = parts.transpose(0, 1).reshape(-1, *local.shape[1:])
    return merged[: layout.real_rows(step)].to(x.device)


def _gather_objects(x: list[T], context: Context, layout: ShardLayout, step: int) -> list[T]:
    parts: list[object] = [None] * context.world_size
    dist.all_gather_object(parts, x)
    ranks = cast(list[list[T]], parts)  # every rank sent a list of len(x) items
    merged = [ranks[rank][row] for row in range(len(x)) for rank in range(context.world_size)]
    return merged[: layout.real_rows(step)]
