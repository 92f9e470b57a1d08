"""The collective halves of a sharded checkpoint's save and load (:mod:`ddpkit.worker.sharded`
holds the format and the trust rule): rank 0 makes the temporary folder, every rank writes or
reads its shards, and any rank's failure raises on every rank (:mod:`ddpkit.worker.agree`)
instead of leaving the others in a collective.

:mod:`ddpkit.worker.sharded` imports torch.distributed.checkpoint and DTensor (about a CPU
second): it is imported only where a sharded state can exist, so that a process saving or
loading a plain checkpoint never pays for it (:func:`parts`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.worker import ckptfiles
from ddpkit.worker.agree import all_gather, broadcast, describe, raise_failures, world

if TYPE_CHECKING:
    from ddpkit.worker import sharded

__all__ = ["commit", "discard", "parts", "read_shards", "sharded_keys", "write_shards"]

# A sharded model is an FSDPModule (torch.distributed.fsdp) or has DTensor parameters
# (torch.distributed.tensor): without either module imported, no value can be one.
_SHARDING_MODULES = ("torch.distributed.fsdp", "torch.distributed.tensor")


def parts(state: Mapping[str, Any]) -> sharded.Parts:
    """:func:`ddpkit.worker.sharded.parts`; {} at once where no sharded value can exist."""
    if not any(name in sys.modules for name in _SHARDING_MODULES):
        return {}
    from ddpkit.worker import sharded

    return sharded.parts(state)


def commit(temp: Path, final: Path) -> None:
    from ddpkit.worker import sharded

    sharded.commit(temp, final)


def discard(path: Path) -> None:
    from ddpkit.worker import sharded

    sharded.discard(path)


def sharded_keys(found: sharded.Parts) -> set[str]:
    return {key for model, optimizers in found.items() for key in (model, *optimizers)}


def write_shards(folder: Path, state: Mapping[str, Any], found: sharded.Parts, step: int) -> Path:
    """Every rank's shards of ``found`` in a temporary folder rank 0 made (a collective);
    returns that folder. Any rank's failure raises on every rank, and the folder is removed."""
    from ddpkit.worker import sharded

    world_size, rank = world()
    temp: Path | None = None
    failure: Exception | None = None
    if rank == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            temp = sharded.new_temp(folder, step)
        except Exception as error:
            failure = error
    name, made = broadcast(world_size, (temp and temp.name, describe(failure)))
    where = f"checkpoint step {step} in {folder}"
    hint = f"check that {folder} is a writable directory with enough free space on every rank"
    raise_failures([made], f"could not make the sharded folder of {where}", hint=hint, own=failure)
    temp = folder / name
    try:
        sharded.write(temp, state, found)
    except Exception as error:  # DCP raises on every rank when one fails; shared all the same
        failure = error
    failures = all_gather(world_size, describe(failure))
    if any(failures) and rank == 0:
        sharded.discard(temp)
    raise_failures(failures, f"could not write its shards of {where}", hint=hint, own=failure)
    return temp


def read_shards(path: Path, payload: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Restore the sharded models and optimizers from checkpoint ``path``'s folder (a
    collective); the targets are checked on every rank before DCP's collectives start."""
    from ddpkit.worker import sharded

    world_size, _ = world()
    found: sharded.Parts = {}
    failure: Exception | None = None
    try:
        found = sharded.check_parts(payload["sharded"], state)
    except Exception as error:
        failure = error
    what = f"could not restore the sharded state of checkpoint step {payload['step']} from {path}"
    hint = "pass the sharded model and its optimizers under the keys they were saved with"
    raise_failures(all_gather(world_size, describe(failure)), what, hint=hint, own=failure)
    try:
        sharded.read(ckptfiles.shards_of(path), state, found)
    except Exception as error:  # DCP raises on every rank when one fails; shared all the same
        failure = error
    hint = f"the folder {ckptfiles.shards_of(path).name} next to it must be complete"
    raise_failures(all_gather(world_size, describe(failure)), what, hint=hint, own=failure)
