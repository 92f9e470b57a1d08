"""ddpkit's DataParallel (``wrap(model, "dp")``) and ``ddpkit.balanced_loss``, on one engine.

:class:`DataParallel` is an ``nn.DataParallel`` (``.module``, ``device_ids``, ``output_device``,
isinstance checks and checkpoints behave as before) whose three steps are replaced: ``scatter``
splits any structure (:mod:`ddpkit.worker.structure`; torch copies a dataclass whole to every
device), names a tensor of the wrong size, and with ``first_device_batch`` puts fewer samples on
the first device, which also holds the outputs and the optimizer state (BalancedDataParallel's
``gpu0_bsz``); ``parallel_apply`` brings grad mode, inference mode, the autocast state *with its
dtype* and the current stream into every replica's thread (:class:`ThreadState`; torch's
re-enters only ``autocast(enabled=...)``: bf16 runs in fp16 in its replicas, CPU autocast and
inference mode are lost); ``gather`` rebuilds the same structures (torch's fails on
dataclasses). Any ``dim`` other than 0 falls back to torch's scatter and gather. BatchNorm is as
in torch's: each replica normalizes with its slice's statistics, and the running statistics of
the first device's slice survive; SyncBatchNorm needs DDP.

``model(x)`` brings every output to the output device; :func:`balanced_loss` computes the loss
beside each slice instead, the same script in every mode::

    step = ddpkit.balanced_loss(model, criterion)     # model as ddpkit.wrap returned it
    loss = step(x, y)                                 # criterion(model(x), y), however run
    loss.backward()

A step object, not a ``loss=`` argument to ``wrap``: the model stays the model, the loss an
explicit call in the loop. Under ``single`` and ``ddp`` the step is exactly
``criterion(model(x), *targets, **kwargs)``; under ``dp`` it splits ``x``, the targets and every
keyword argument with rows alike, runs the criterion beside each replica, and only what it
returns reaches the output device (never every replica's logits). Scalars are combined as the
mean weighted by slice size, ``sum(n_i * l_i) / N``: for a mean-reduced loss, the whole batch's
loss on one device, also for uneven slices (an unweighted mean gives a lone sample of 3/3/3/1
three times the weight). ``reduction="sum"`` adds them; ``"auto"`` reads
``criterion.reduction``; tensors with rows are joined in batch order. :class:`Args` passes
several model inputs; a criterion module holding tensors (class weights) is replicated with it.

On CPU "devices" the slices share the one module, called from several threads; autograd
accumulates the same sum of per-slice gradients as on GPUs, so the path is tested on CPU.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import replicate

from ddpkit.errors import ConfigError
from ddpkit.worker.structure import (
    REDUCTIONS,
    batch_rows,
    combine,
    concat,
    map_tensors,
    split,
    split_sizes,
)

__all__ = [
    "Args",
    "BalancedLoss",
    "DataParallel",
    "ThreadState",
    "balanced_loss",
    "device_of",
    "replicas_for",
    "run_parallel",
    "scatter_to",
]

T = TypeVar("T")
_AUTOCAST_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class ThreadState:
    """The thread-local state a replica's thread must share with the caller."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of each enabled one
    autocast_cache: bool

    @classmethod
    def capture(cls) -> ThreadState:
        """The calling thread's state."""
        enabled = tuple(
            (kind, torch.get_autocast_dtype(kind))
            for kind in _AUTOCAST_TYPES
            if torch.is_autocast_enabled(kind)
        )
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            autocast=enabled,
            autocast_cache=torch.is_autocast_cache_enabled(),
        )

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Enter this state in the current thread for the duration of the block."""
        with ExitStack() as stack:
            if self.inference_mode:
                stack.enter_context(torch.inference_mode())
            else:
                stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for kind, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(kind, dtype=dtype, cache_enabled=self.autocast_cache)
                )
            yield


def device_of(index: int | torch.device) -> torch.device:
    """A device as ``nn.DataParallel`` names it: an index of a GPU, -1 for the CPU, or a device."""
    if isinstance(index, torch.device):
        return index
    return torch.device("cpu") if index == -1 else torch.device("cuda", index)


def scatter_to(
    batch: Any, devices: Sequence[torch.device], *, first: int | None = None
) -> tuple[list[Any], list[int]]:
    """``batch`` cut into slices (split as :func:`split_sizes` says), each moved to its device.

    Returns the slices and their sizes; devices left without samples (a batch smaller than the
    device count) get no slice, so the slices go to a prefix of ``devices``. A batch without a
    tensor of rows goes whole to the first device.
    """
    rows = batch_rows(batch)
    sizes = [size for size in split_sizes(rows or 0, len(devices), first=first) if size]
    if rows is None or not sizes:
        return [_moved(batch, devices[0])], [rows or 0]
    parts = split(batch, sizes, rows=rows)
    return [_moved(part, device) for part, device in zip(parts, devices, strict=False)], sizes


def _moved(value: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return map_tensors(value, lambda tensor: tensor.to(device))
    return map_tensors(value, lambda tensor: tensor.to(device, non_blocking=True))


def replicas_for(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One module per entry of ``devices``: ``module`` itself where it lives (and for CPU
    devices), a replica from torch's ``replicate`` (gradients flow back to ``module``) elsewhere.
    """
    home = next((t.device for t in itertools.chain(module.parameters(), module.buffers())), None)
    if home is None or all(device == home or device.type == "cpu" for device in devices):
        return [module] * len(devices)
    if home.type != "cuda" or devices[0] != home:
        raise ConfigError(
            f"the model lives on {home}, the first device is {devices[0]}",
            hint="DataParallel needs every parameter and buffer on its first device; move the "
            "model there first (ddpkit.wrap does)",
        )
    others = list(dict.fromkeys(device for device in devices if device != home))
    copies = replicate(module, [home, *others], not torch.is_grad_enabled())
    by_device = {home: module, **dict(zip(others, copies[1:], strict=True))}
    return [by_device[device] for device in devices]


def run_parallel(fn: Callable[[int], T], devices: Sequence[torch.device]) -> list[T]:
    """``[fn(i) for i in range(len(devices))]``, each call in its own thread on ``devices[i]``
    (its current stream as the caller sees it) with the caller's :class:`ThreadState`.

    One device runs in the calling thread. The first exception raised in a thread is raised
    here, with a note naming the slice and device.
    """
    state = ThreadState.capture()
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]
    results: list[Any] = [None] * len(devices)
    errors: list[BaseException | None] = [None] * len(devices)

    def work(index: int) -> None:
        try:
            with state.applied(), _on(devices[index], streams[index]):
                results[index] = fn(index)
        except BaseException as error:  # re-raised in the caller below
            errors[index] = error

    if len(devices) == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(index,)) for index in range(len(devices))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for index, error in enumerate(errors):
        if error is not None:
            error.add_note(f"(in slice {index} of {len(devices)}, on {devices[index]})")
            raise error
    return results


@contextmanager
def _on(device: torch.device, stream: Any) -> Iterator[None]:
    if device.type != "cuda":  # CPU "devices": nothing to select
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


class DataParallel(nn.DataParallel):  # type: ignore[type-arg]
    """``nn.DataParallel(module, device_ids, output_device, dim)`` plus ``first_device_batch``."""

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        *,
        first_device_batch: int | None = None,
    ) -> None:
        split_sizes(1, 1, first=first_device_batch)  # validates it: one line naming the value
        super().__init__(module, device_ids, output_device, dim)
        self.dim = dim  # torch sets it only when a GPU exists
        self.first_device_batch = first_device_batch

    def scatter(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[int | torch.device],
    ) -> Any:
        if self.dim != 0:
            return super().scatter(inputs, kwargs, device_ids)
        devices = [device_of(index) for index in device_ids]
        slices, _ = scatter_to((inputs, kwargs or {}), devices, first=self.first_device_batch)
        return tuple(part[0] for part in slices), tuple(part[1] for part in slices)

    def parallel_apply(
        self, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any
    ) -> list[Any]:
        devices = [device_of(index) for index in self.device_ids[: len(replicas)]]
        return run_parallel(lambda i: replicas[i](*inputs[i], **kwargs[i]), devices)

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        if self.dim != 0:
            return super().gather(outputs, output_device)
        target = device_of(output_device)
        return concat([map_tensors(output, lambda tensor: tensor.to(target)) for output in outputs])


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
