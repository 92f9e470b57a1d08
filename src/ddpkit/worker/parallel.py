"""The multi-replica engine under ``dp``: slices to devices, one thread per slice, replicas.

Why not torch's ``parallel_apply``: autocast and grad mode are thread-local, and torch re-enters
in its worker threads only ``autocast(enabled=...)``: the dtype falls back to the default (bf16
autocast runs in fp16 in the replicas), CPU autocast and inference mode are lost.
:class:`ThreadState` carries all of it.

When every device is the CPU the slices share the one module, called from several threads;
autograd accumulates the same sum of per-slice gradients as on GPUs, so the whole
device-independent path runs, and is tested, on CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import replicate

from ddpkit.errors import ConfigError
from ddpkit.worker.structure import batch_rows, map_tensors, split, split_sizes

__all__ = ["ThreadState", "device_of", "replicas_for", "run_parallel", "scatter_to"]

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
    home = _home(module)
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


def _home(module: nn.Module) -> torch.device | None:
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return None


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
