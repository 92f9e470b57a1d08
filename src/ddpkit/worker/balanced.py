"""``ddpkit.balanced_loss``: the loss computed beside each slice, the same script in every mode.

    step = ddpkit.balanced_loss(model, criterion)     # model as ddpkit.wrap returned it
    loss = step(x, y)                                 # criterion(model(x), y), however run
    loss.backward()

A step object rather than a ``loss=`` argument to ``wrap``: the model stays the model and the
loss stays an explicit call in the loop. Under ``single`` and ``ddp`` the step is exactly
``criterion(model(x), *targets, **kwargs)``; under ``dp`` it splits ``x``, the targets and every
keyword argument with rows alike, runs the criterion beside each replica in its own thread, and
only what the criterion returns reaches the output device (never every replica's logits).

Scalars are combined as the mean weighted by slice size, ``sum(n_i * l_i) / N``, which for a
mean-reduced loss equals the whole batch's loss on one device, also for uneven slices (an
unweighted mean gives a lone sample of 3/3/3/1 three times the weight). ``reduction="sum"`` adds
them; ``"auto"`` reads ``criterion.reduction``. Tensors with rows in what the criterion returns
are joined in batch order. :class:`Args` passes several model inputs; a criterion module
holding tensors (class weights) is replicated with the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.worker.parallel import device_of, replicas_for, run_parallel, scatter_to
from ddpkit.worker.structure import REDUCTIONS, combine, map_tensors, split_sizes

__all__ = ["Args", "BalancedLoss", "balanced_loss"]


@dataclass(frozen=True, init=False)
class Args:
    """Positional and keyword arguments for the model: ``model(*args, **kwargs)`` per slice."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)


def balanced_loss(
    model: nn.Module,
    criterion: Callable[..., Any],
    *,
    reduction: str = "auto",
    devices: Sequence[str | torch.device] | None = None,
    output_device: str | torch.device | None = None,
    first_device_batch: int | None = None,
) -> BalancedLoss:
    """A step computing ``criterion(model(inputs), *targets, **kwargs)`` the best way for
    ``model``: per device beside each slice when ``model`` is a DataParallel with devices (as
    ``ddpkit.wrap`` returns under ``dp``), plainly otherwise.

    ``devices``/``output_device`` name the devices explicitly (default: the DataParallel's);
    CPU devices share the one module (a CPU run of the same path). ``first_device_batch``: at
    most that many samples on the first device (default: the DataParallel's setting).
    """
    if not callable(criterion):
        raise ConfigError(
            f"criterion={criterion!r} is not callable",
            hint="pass a loss module or function, e.g. nn.CrossEntropyLoss()",
        )
    wrapper = model if isinstance(model, nn.DataParallel) else None
    ids: list[int] = list(wrapper.device_ids) if wrapper is not None else []
    chosen: list[torch.device] | None = None
    if devices is not None:
        chosen = [torch.device(device) for device in devices]
        if not chosen:
            raise ConfigError("devices=[] is empty", hint="name a device or more, or None")
    elif ids:
        chosen = [torch.device("cuda", index) for index in ids]
    if output_device is None and devices is None and wrapper is not None and ids:
        output_device = device_of(wrapper.output_device)
    if first_device_batch is None and wrapper is not None:
        first_device_batch = getattr(wrapper, "first_device_batch", None)
    split_sizes(1, 1, first=first_device_batch)  # validates it: one line naming the value
    return BalancedLoss(
        model,
        wrapper.module if wrapper is not None else model,
        criterion,
        _reduction(criterion, reduction),
        chosen,
        torch.device(output_device) if output_device is not None else None,
        first_device_batch,
    )


@dataclass(frozen=True)
class BalancedLoss:
    """See :func:`balanced_loss`; ``step(inputs, *targets, **kwargs)`` returns the loss."""

    model: nn.Module
    module: nn.Module  # the model under its DataParallel
    criterion: Callable[..., Any]
    reduction: str
    devices: list[torch.device] | None  # None: the plain call
    output_device: torch.device | None
    first_device_batch: int | None

    def __call__(self, inputs: Any, *targets: Any, **kwargs: Any) -> Any:
        if self.devices is None:
            return self.criterion(_forward(self.model, inputs), *targets, **kwargs)
        devices = self.devices
        output = self.output_device or devices[0]
        slices, sizes = scatter_to(
            (inputs, targets, kwargs), devices, first=self.first_device_batch
        )
        used = devices[: len(slices)]
        models = replicas_for(self.module, used)
        losses = _criteria(self.criterion, used)

        def one(index: int) -> Any:
            part_inputs, part_targets, part_kwargs = slices[index]
            outputs = _forward(models[index], part_inputs)
            return losses[index](outputs, *part_targets, **part_kwargs)

        results = run_parallel(one, used)
        moved = [map_tensors(result, lambda tensor: tensor.to(output)) for result in results]
        return combine(moved, sizes, reduction=self.reduction)


def _forward(model: Callable[..., Any], inputs: Any) -> Any:
    if isinstance(inputs, Args):
        return model(*inputs.args, **inputs.kwargs)
    return model(inputs)


def _criteria(criterion: Callable[..., Any], devices: list[torch.device]) -> list[Any]:
    if isinstance(criterion, nn.Module) and any(True for _ in criterion.state_dict()):
        return replicas_for(criterion, devices)
    return [criterion] * len(devices)


def _reduction(criterion: Callable[..., Any], reduction: str) -> str:
    if reduction == "auto":
        found = getattr(criterion, "reduction", None)
        return found if found in REDUCTIONS else "mean"
    if reduction not in REDUCTIONS:
        raise ConfigError(
            f"reduction={reduction!r} is not a known reduction",
            hint="'auto' (from criterion.reduction), 'mean' or 'sum'",
        )
    return reduction
