"""Metrics across ranks: ``ddpkit.reduce`` (one collective) and ``ddpkit.Mean`` (an epoch's mean).

The pitfall (TRL #7010, and pytorch#25162's evaluation twin): each rank averages its own shard,
then the ranks' means are averaged. That is off twice. ``DistributedSampler`` pads an epoch so
that every rank gets as many samples, by repeating the head of the order, so the repeated
samples count twice; and a mean of means weighs every rank alike, whatever its number of real
samples. Five samples with losses ``[10, 0, 0, 0, 0]`` on 2 ranks: rank 0 holds samples 0, 2, 4,
rank 1 holds 1, 3 and sample 0 again; both ranks' means are 3.33, the true mean is 2.0.

``Mean`` keeps a running sum and count per rank; inside a ``ddpkit.loader`` loop, ``update`` takes
one value per sample of the batch and leaves out this rank's padded rows (the loader knows which
they are, as :func:`ddpkit.gather` does), and ``compute`` sums both over the ranks in one
all-reduce: the mean over the epoch's real samples, exact. ``reduce(value, op, weight=n)`` is the
collective underneath, for a value that is already an aggregate: with ``weight`` (the samples
behind this rank's value) the mean is weighted by it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Literal, overload

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.worker.context import current
from ddpkit.worker.gather import comm_device
from ddpkit.worker.loader import active_pass

__all__ = ["OPS", "Mean", "reduce"]

Op = Literal["mean", "sum", "max"]
OPS: tuple[str, ...] = ("mean", "sum", "max")


@overload
def reduce(
    value: torch.Tensor, op: Op = "mean", *, weight: float | None = None
) -> torch.Tensor: ...
@overload
def reduce(value: int, op: Literal["sum", "max"], *, weight: None = None) -> int: ...
@overload
def reduce(value: float, op: Op = "mean", *, weight: float | None = None) -> float: ...
def reduce(
    value: torch.Tensor | float, op: Op = "mean", *, weight: float | None = None
) -> torch.Tensor | float:
    """``value`` reduced over every rank: a tensor (same shape, dtype and device) or a number.

    ``op``: ``"mean"`` (a float for a number), ``"sum"`` or ``"max"`` (an int stays an int).
    ``weight``: with ``"mean"``, the number of samples behind this rank's value: the result is
    ``sum(weight_r * value_r) / sum(weight_r)`` (NaN when every weight is 0); without it every
    rank weighs the same. Call it on every rank (a collective); needs ``ddpkit.init()``.
    For an epoch's mean over a ``ddpkit.loader``, use :class:`Mean`: a per-rank batch mean
    already counts the sampler's padded duplicates.
    """
    context = current()
    _check(value, op, weight)
    if isinstance(value, torch.Tensor):
        wide = torch.float64 if value.is_floating_point() else torch.int64
        local = value.detach().to(comm_device(context.backend, context.device, value.device))
        result = _reduce_flat(local.to(wide, copy=True).reshape(-1), op, weight, context.world_size)
        return result.reshape(value.shape).to(dtype=value.dtype, device=value.device)
    exact = isinstance(value, int) and op != "mean"
    device = comm_device(context.backend, context.device, torch.device("cpu"))
    local = torch.tensor([value], dtype=torch.int64 if exact else torch.float64, device=device)
    number = _reduce_flat(local, op, weight, context.world_size).item()
    return int(number) if exact else float(number)


def _reduce_flat(
    local: torch.Tensor, op: str, weight: float | None, world_size: int
) -> torch.Tensor:
    if op == "mean":  # one all-reduce of [w * value..., w]
        w = 1.0 if weight is None else float(weight)
        packed = torch.cat([local * w, local.new_tensor([w])])
        if world_size > 1:
            dist.all_reduce(packed)
        return packed[:-1] / packed[-1]
    if world_size > 1:
        dist.all_reduce(local, dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return local


def _check(value: object, op: object, weight: object) -> None:
    if op not in OPS:
        raise ConfigError(
            f"reduce(op={op!r}) is not a known reduction",
            hint="choose " + ", ".join(repr(name) for name in OPS),
        )
    if isinstance(value, bool) or not isinstance(value, torch.Tensor | int | float):
        raise ConfigError(
            f"reduce(value) got {type(value).__name__}",
            hint="pass a tensor, an int or a float (a loss: loss.item() or the tensor)",
        )
    if isinstance(value, torch.Tensor) and op == "mean" and not value.is_floating_point():
        raise ConfigError(
            f"reduce(value, op='mean') got a {value.dtype} tensor",
            hint="a mean of integers is not an integer: pass value.float(), or use op='sum'",
        )
    if weight is None:
        return
    if op != "mean":
        raise ConfigError(
            f"reduce(op={op!r}, weight={weight!r}): a weight only applies to op='mean'",
            hint="drop weight=, or use op='mean'",
        )
    _check_weight(weight, "reduce")


def _check_weight(weight: object, caller: str) -> None:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight >= 0:
        raise ConfigError(
            f"{caller}(weight={weight!r}) must be a number >= 0",
            hint="the number of samples behind this rank's value, e.g. weight=len(batch)",
        )


class Mean:
    """A running mean over an epoch's real samples, exact across ranks (see the module doc).

    ``update(values)`` takes one value per sample (a tensor of one row per sample, or a
    sequence of numbers); inside a ``ddpkit.loader`` loop, the batch's padded rows on this
    rank are left out. ``update(value, weight=n)`` adds a value that is already the mean of
    ``n`` samples. ``compute()`` is a collective (call it on every rank): the mean over every
    rank's samples, NaN when none was added. ``reset()`` starts over (e.g. each epoch).
    """

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0.0
        self._warned = False

    def update(
        self, values: torch.Tensor | Sequence[float] | float, *, weight: float | None = None
    ) -> None:
        if weight is not None:
            _check_weight(weight, "Mean.update")
            one = float(values.item() if isinstance(values, torch.Tensor) else values)  # type: ignore[arg-type]
            self._warn_if_padded()
            self.total += one * float(weight)
            self.count += float(weight)
            return
        flat = torch.as_tensor(values, dtype=torch.float64).detach().cpu()
        if flat.dim() == 0:
            raise ConfigError(
                "Mean.update got a single number without weight=",
                hint="pass one value per sample (e.g. the loss with reduction='none'), or "
                "update(batch_mean, weight=len(batch))",
            )
        real = flat[: self._real_rows(int(flat.shape[0]))]
        self.total += float(real.sum())
        self.count += float(real.numel())

    def compute(self) -> float:
        summed = reduce(torch.tensor([self.total, self.count], dtype=torch.float64), "sum")
        return float(summed[0] / summed[1]) if summed[1] > 0 else float("nan")

    def reset(self) -> None:
        self.total, self.count = 0.0, 0.0

    def _real_rows(self, rows: int) -> int:
        found = active_pass()
        if found is None:
            return rows
        layout, step = found.loader.layout, found.step
        expected = layout.rows(step)
        if rows != expected:
            raise ConfigError(
                f"Mean.update got {rows} values for step {step} of a ddpkit.loader pass, whose "
                f"batch has {expected} rows",
                hint="pass one value per sample of the batch (e.g. the loss with "
                "reduction='none'), or update(batch_mean, weight=len(batch))",
            )
        return layout.rank_real_rows(step, current().rank)

    def _warn_if_padded(self) -> None:
        found = active_pass()
        if found is None or self._warned:
            return
        layout, step = found.loader.layout, found.step
        if layout.rank_real_rows(step, current().rank) < layout.rows(step):
            self._warned = True
            warnings.warn(
                f"Mean.update(value, weight=...) at step {step}, whose batch holds padded "
                "duplicates on this rank: the value counts them; pass one value per sample "
                "instead and they are left out",
                RuntimeWarning,
                stacklevel=3,
            )
