"""timm's distributed helpers.

Source: huggingface/pytorch-image-models, timm/utils/distributed.py (``reduce_tensor``,
``distribute_bn``, ``is_global_primary``/``is_local_primary``/``is_primary``,
``is_distributed_env``, ``world_info_from_env``, ``init_distributed_device`` and
``init_distributed_device_so``). Shapes that matter: ``distribute_bn`` walks the model's
buffers and broadcasts (or all-reduces) each BatchNorm running statistic, one collective per
buffer; ``init_distributed_device_so`` calls ``init_process_group`` itself (``env://``, gloo
for a CPU device) and returns a dict the ``args`` variant copies onto its namespace.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def reduce_tensor(tensor: torch.Tensor, n: int) -> torch.Tensor:
    reduced = tensor.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    reduced /= n
    return reduced


def distribute_bn(model: torch.nn.Module, world_size: int, reduce: bool = False) -> None:
    """Make every rank's BatchNorm running statistics the same: rank 0's, or their mean."""
    module = getattr(model, "module", model)  # timm's unwrap_model for DDP
    for name, buffer in module.named_buffers(recurse=True):
        if "running_mean" in name or "running_var" in name:
            if reduce:
                dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
                buffer /= float(world_size)
            else:
                dist.broadcast(buffer, 0)


def is_global_primary(args: Any) -> bool:
    return bool(args.rank == 0)


def is_local_primary(args: Any) -> bool:
    return bool(args.local_rank == 0)


def is_primary(args: Any, local: bool = False) -> bool:
    return is_local_primary(args) if local else is_global_primary(args)


def is_distributed_env() -> bool:
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if name in os.environ:
            return int(os.environ[name]) > 1
    return False


def _first_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def world_info_from_env() -> tuple[int, int, int]:
    """(local rank, global rank, world size) from torchrun's, MPI's or SLURM's variables."""
    local_rank = _first_int(
        ("LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"), 0
    )
    global_rank = _first_int(("RANK", "PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"), 0)
    world_size = _first_int(("WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"), 1)
    return local_rank, global_rank, world_size


def init_distributed_device_so(
    device: str = "cuda", dist_backend: str | None = None, dist_url: str | None = None
) -> dict[str, Any]:
    distributed, world_size, global_rank, local_rank = False, 1, 0, 0
    device_type = device.split(":", maxsplit=1)[0]
    if dist_backend is None:
        dist_backend = {"cuda": "nccl", "xpu": "ccl", "hpu": "hccl"}.get(device_type, "gloo")
    dist_url = dist_url or "env://"
    if is_distributed_env():
        local_rank, _, _ = world_info_from_env()
        dist.init_process_group(backend=dist_backend, init_method=dist_url)
        world_size = dist.get_world_size()
        global_rank = dist.get_rank()
        distributed = True
    if distributed and device != "cpu":
        device = f"{device_type}:{local_rank}"
    if device.startswith("cuda:"):
        torch.cuda.set_device(device)
    return {
        "device": device,
        "global_rank": global_rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "distributed": distributed,
    }


def init_distributed_device(args: Any) -> torch.device:
    result = init_distributed_device_so(
        device=getattr(args, "device", "cuda"),
        dist_backend=getattr(args, "dist_backend", None),
        dist_url=getattr(args, "dist_url", None),
    )
    args.device = result["device"]
    args.world_size = result["world_size"]
    args.rank = result["global_rank"]
    args.local_rank = result["local_rank"]
    args.distributed = result["distributed"]
    return torch.device(args.device)
