"""``nn.DataParallel`` with ddpkit's scatter, threads and gather: ``wrap(model, "dp")``.

It is an ``nn.DataParallel`` (``.module``, ``device_ids``, ``output_device``, isinstance checks
and checkpoints behave as before) whose three steps are replaced:

- ``scatter``: any structure is split (dataclasses too, which torch copies whole to every
  device), a tensor of the wrong size is an error naming where it is, and
  ``first_device_batch`` puts fewer samples on the first device (BalancedDataParallel's
  ``gpu0_bsz``) when it also holds the outputs and the optimizer state;
- ``parallel_apply``: grad mode, inference mode, the autocast state *with its dtype* and the
  current stream reach every replica's thread (torch's keeps only the enabled flag);
- ``gather``: the same structures back (torch's fails on dataclasses).

Calling it as ``model(x)`` still brings every output to the output device: for training, pair
it with :func:`ddpkit.balanced_loss`, which computes the loss beside each slice instead.
Any ``dim`` other than 0 falls back to torch's own scatter and gather.

BatchNorm: as in torch's DataParallel, each replica normalizes with its own slice's statistics,
and the running statistics that survive are those of the first device's slice (the replica
there shares the module's buffers). ddpkit does not change this; SyncBatchNorm needs DDP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ddpkit.worker.parallel import device_of, run_parallel, scatter_to
from ddpkit.worker.structure import concat, map_tensors, split_sizes

__all__ = ["DataParallel"]


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
