"""Where a model's parts stay: the pure decision ``wrap`` takes for a model split across devices.

A model whose parameters and buffers are on one device (or none) is moved to the context's
device as always. A model the user split across devices (an embedding on the CPU and the rest
on ``cuda:0``; layers on ``cuda:0`` and ``cuda:1``) is never moved behind the user's back:

    resolved strategy  parts on                  decision
    single             anything                  keep the placement, return the model
    dp (from auto)     several devices           single: keep the placement (DataParallel needs
                                                 every parameter on its first device)
    dp (explicit)      several devices           ConfigError: say so, point at 'single'
    ddp                GPUs only                 DDP with device_ids=None (torch's rule for a
                                                 module spanning GPUs), no move
    ddp                CPU and GPU mixed         ConfigError: DDP refuses it; the ways out
    ddp                GPUs, device_ids given    ConfigError: torch refuses device_ids there
    fsdp               several devices           ConfigError: fully_shard shards one device's
                                                 parameters per rank

Takes device names (``"cpu"``, ``"cuda:0"``), imports no torch: a table the tests walk on CPU.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ddpkit.errors import ConfigError

__all__ = ["Placement", "plan_placement"]


@dataclass(frozen=True)
class Placement:
    """What ``wrap`` does with a model: the strategy, whether to move it, DDP's device_ids."""

    strategy: str
    move: bool
    # "default": this rank's GPU on CUDA (nothing on CPU); None: a module spanning GPUs
    ddp_device_ids: str | None = "default"


def plan_placement(
    devices: Collection[str], *, requested: str, chosen: str, ddp_options: Collection[str] = ()
) -> Placement:
    """The decision for a model whose tensors are on ``devices`` (``chosen``: the strategy
    :func:`ddpkit.worker.wrap.resolve_strategy` picked for ``requested``)."""
    placed = sorted(set(devices))  # "meta" counts: such a module cannot be moved either
    if len(placed) <= 1:
        return Placement(chosen, move=True)
    where = ", ".join(placed)
    if chosen == "single":
        return Placement("single", move=False)
    if chosen == "dp":
        if requested == "auto":
            return Placement("single", move=False)
        raise ConfigError(
            f"strategy='dp' with a model split across {where}: DataParallel needs every "
            "parameter and buffer on its first device",
            hint="use strategy='single' (or 'auto'), which keeps your placement in one process",
        )
    if chosen == "fsdp":
        raise ConfigError(
            f"strategy='fsdp' with a model split across {where}: FSDP2 shards parameters that "
            "live on one device per rank",
            hint="build the model on one device (wrap moves it to this rank's), or use "
            "strategy='ddp' or 'single', which keep your placement",
        )
    if any(not name.startswith("cuda") for name in placed):
        raise ConfigError(
            f"strategy={requested!r} resolved to DDP for a model split across {where}: DDP "
            "needs every part on GPUs (or every part on the CPU)",
            hint="move the CPU parts to a GPU of this process (a task may own several, "
            "gpus_per_task: 2), or run one process with strategy='single'",
        )
    if "device_ids" in ddp_options:
        raise ConfigError(
            f"device_ids given for a model split across {where}: DDP takes device_ids=None for "
            "a module on several GPUs",
            hint="drop device_ids; ddpkit passes None for such a model",
        )
    return Placement("ddp", move=False, ddp_device_ids=None)
