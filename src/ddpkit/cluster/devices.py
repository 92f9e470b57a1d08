"""Which device each rank uses, and whether two ranks ended up on one GPU. Pure: no torch import.

``choose_device`` decides from plain values (the caller reads them from torch and the
environment), so every layout is table-tested without a GPU:

* no CUDA → ``cpu``;
* at least one visible GPU per local rank → ``cuda:<local_rank>``;
* fewer GPUs than ranks on the node, all of them named by ``CUDA_VISIBLE_DEVICES`` → ``cuda:0``:
  the scheduler gives each task GPUs of its own (SLURM ``--gpus-per-task=N``, Lightning#16828),
  which the task numbers from 0; with N > 1 the process owns several GPUs (a model split across
  them under DDP) and computes on its first one;
* fewer visible GPUs than ranks on the node otherwise → :class:`TopologyError`, before anything
  can hang or silently share a GPU.

Per-task GPUs cannot be told apart from a node-wide ``CUDA_VISIBLE_DEVICES=0,1`` given to more
ranks, so after the process group forms ``ddpkit.init`` gathers every rank's hostname and the
uuids of the GPUs it uses (:func:`owned_devices`: all it sees when they are its own), and
:func:`check_distinct_gpus` rejects a GPU that two ranks use.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpkit.errors import TopologyError

__all__ = ["check_distinct_gpus", "choose_device", "owned_devices", "parse_visible_devices"]


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
    if _owns_what_it_sees(device_count, cuda_visible_devices):
        return "cuda:0"
    shown = "<unset>" if cuda_visible_devices is None else cuda_visible_devices
    raise TopologyError(
        f"LOCAL_WORLD_SIZE={local_world_size} ranks on this node but only {device_count} "
        f"GPUs visible (CUDA_VISIBLE_DEVICES={shown}) → two ranks would share a GPU",
        hint=(
            "start one process per GPU (torchrun --nproc-per-node=gpu, or srun with "
            "--ntasks-per-node equal to the GPUs per node), give each task its own GPU "
            "(--gpus-per-task=N), or pass device='cpu' / device=... to ddpkit.init()"
        ),
    )


def _owns_what_it_sees(device_count: int, cuda_visible_devices: str | None) -> bool:
    """The task sees only GPUs given to it: CUDA_VISIBLE_DEVICES names each GPU it sees."""
    visible = parse_visible_devices(cuda_visible_devices)
    return visible is not None and len(visible) == device_count >= 1


def owned_devices(
    chosen: int, local_world_size: int, device_count: int, cuda_visible_devices: str | None
) -> list[int]:
    """The CUDA indexes this rank uses, given its device ``cuda:<chosen>``: every GPU it sees
    when it sees fewer than the node's ranks (its own GPUs, see :func:`choose_device`), else
    only the chosen one. These are what :func:`check_distinct_gpus` checks across ranks."""
    if device_count < local_world_size and _owns_what_it_sees(device_count, cuda_visible_devices):
        return list(range(device_count))
    return [chosen]


def check_distinct_gpus(identities: Sequence[tuple[str, Sequence[str]]]) -> None:
    """Raise if two ranks use the same GPU; ``identities[rank] = (hostname, its GPU uuids)``."""
    first_rank: dict[tuple[str, str], int] = {}
    clashes: list[str] = []
    for rank, (host, uuids) in enumerate(identities):
        for uuid in dict.fromkeys(uuids):
            if (host, uuid) in first_rank:
                other = first_rank[host, uuid]
                clashes.append(f"ranks {other} and {rank} on {host} share GPU {uuid}")
            else:
                first_rank[host, uuid] = rank
    if clashes:
        raise TopologyError(
            "two ranks use the same GPU: " + "; ".join(clashes),
            hint=(
                "CUDA_VISIBLE_DEVICES probably names the same GPU for several tasks on a node; "
                "use --gpus-per-task=N (each task its own GPUs) or one process per GPU with "
                "CUDA_VISIBLE_DEVICES unset"
            ),
        )
