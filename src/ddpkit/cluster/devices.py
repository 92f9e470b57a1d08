"""Which device each rank uses, and whether two ranks ended up on one GPU. Pure: no torch import.

``choose_device`` decides from plain values (the caller reads them from torch and the
environment), so every layout is table-tested without a GPU:

* no CUDA → ``cpu``;
* at least one visible GPU per local rank → ``cuda:<local_rank>``;
* exactly one GPU visible through ``CUDA_VISIBLE_DEVICES`` → ``cuda:0``: the scheduler isolates
  one GPU per task (SLURM ``--gpus-per-task=1``, Lightning#16828), each task calls it cuda:0;
* fewer visible GPUs than ranks on the node otherwise → :class:`TopologyError`, before anything
  can hang or silently share a GPU.

Isolation cannot be told apart from a node-wide ``CUDA_VISIBLE_DEVICES=0`` given to several
ranks, so after the process group forms ``ddpkit.init`` gathers every rank's
(hostname, GPU uuid) and :func:`check_distinct_gpus` rejects duplicates.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpkit.errors import TopologyError

__all__ = ["check_distinct_gpus", "choose_device", "parse_visible_devices"]


def parse_visible_devices(text: str | None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (``None`` when unset; ``[]`` when empty)."""
    if text is None:
        return None
    return [item.strip() for item in text.split(",") if item.strip()]


def choose_device(
    local_rank: int,
    local_world_size: int,
    cuda_available: bool,
    device_count: int,
    cuda_visible_devices: str | None,
) -> str:
    """The device string (``"cpu"`` or ``"cuda:<i>"``) this rank should use; see the module doc."""
    if not 0 <= local_rank < local_world_size:
        raise TopologyError(
            f"LOCAL_RANK={local_rank} is outside [0, LOCAL_WORLD_SIZE={local_world_size})",
            hint="the launcher's LOCAL_RANK/LOCAL_WORLD_SIZE disagree; check tasks per node",
        )
    if not cuda_available or device_count < 1:
        return "cpu"
    if device_count >= local_world_size:
        return f"cuda:{local_rank}"
    visible = parse_visible_devices(cuda_visible_devices)
    if device_count == 1 and visible is not None and len(visible) == 1:
        return "cuda:0"
    shown = "<unset>" if cuda_visible_devices is None else cuda_visible_devices
    raise TopologyError(
        f"LOCAL_WORLD_SIZE={local_world_size} ranks on this node but only {device_count} "
        f"GPUs visible (CUDA_VISIBLE_DEVICES={shown}) → two ranks would share a GPU",
        hint=(
            "start one process per GPU (torchrun --nproc-per-node=gpu, or srun with "
            "--ntasks-per-node equal to the GPUs per node), give each task its own GPU "
            "(--gpus-per-task=1), or pass device='cpu' / device=... to ddpkit.init()"
        ),
    )


def check_distinct_gpus(identities: Sequence[tuple[str, str]]) -> None:
    """Raise if two ranks use the same GPU; ``identities[rank] = (hostname, gpu_uuid)``."""
    first_rank: dict[tuple[str, str], int] = {}
    clashes: list[str] = []
    for rank, identity in enumerate(identities):
        if identity in first_rank:
            host, uuid = identity
            clashes.append(f"ranks {first_rank[identity]} and {rank} on {host} share GPU {uuid}")
        else:
            first_rank[identity] = rank
    if clashes:
        raise TopologyError(
            "two ranks use the same GPU: " + "; ".join(clashes),
            hint=(
                "CUDA_VISIBLE_DEVICES probably names the same GPU for several tasks on a node; "
                "use --gpus-per-task=1 or one process per GPU with CUDA_VISIBLE_DEVICES unset"
            ),
        )
