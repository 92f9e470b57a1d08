"""Sharded (FSDP2) state in a checkpoint: torch.distributed.checkpoint under ddpkit's rules.

A model sharded with ``wrap(model, "fsdp")`` holds one shard of each parameter per rank
(DTensors); rank 0 alone cannot write it. Such a model, and the optimizers that step its
parameters, are saved by every rank through torch.distributed.checkpoint (DCP), with
``get_state_dict`` / ``set_state_dict`` for model and optimizer together, next to the
checkpoint's ordinary file:

    ckpt-<step>-<sequence>[-<run>-a<n>].pt    the rest of the state, RNGs, step, and which keys
                                              are sharded ("sharded": {model: [optimizers]})
    ckpt-<step>-<sequence>[-<run>-a<n>].dcp/  DCP's folder: __<rank>_0.distcp per rank that
                                              wrote, and .metadata

Complete or absent: rank 0 creates a hidden temporary folder ``.ckpt-<step>-<token>.dcp.tmp``,
every rank writes its shards there (fsynced), rank 0 renames the folder to its final name,
fsyncs the parent, and only then writes the ``.pt`` file (itself atomically): a checkpoint
exists when its ``.pt`` does, and a load never looks at a ``.dcp`` folder without one. A dead
writer's temporary folder, and a ``.dcp`` folder whose ``.pt`` never came, are removed by a
later save once untouched for :data:`~ddpkit.worker.durable.STALE_AFTER_S` (a live writer's
files keep changing); a pruned checkpoint takes its folder with it. Any rank's failure to write
or read its shards raises on every rank (:mod:`ddpkit.worker.agree`), none left in a collective.

Resharding is DCP's: a checkpoint saved at 2 ranks loads at 3 (or 1), each rank reading the
pieces of its new shards.

Trust: DCP's ``.metadata`` is a pickle, and its reader unpickles it unrestricted; DCP's planner
also unpickles every non-tensor value (an optimizer's ``lr``) with ``weights_only=False``.
ddpkit never runs either on what it did not write. The metadata is read *weights-only*, by an
unpickler that builds only the globals DCP's metadata is made of
(:data:`ddpkit.compat.DCP_METADATA_GLOBALS`, and torch's dtypes) and refuses any other with
:class:`~ddpkit.errors.CheckpointError`, before anything of it runs; every file it names must
be a plain name inside the folder. Each non-tensor value is loaded with
``torch.load(weights_only=True)`` first; DCP's planner then only unpickles the copy ddpkit
wrote of what that load built. Tensors DCP already reads weights-only.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import secrets
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from ddpkit import compat
from ddpkit.errors import CheckpointError, ConfigError, DdpkitError
from ddpkit.worker.agree import all_gather, broadcast, describe, raise_failures, world
from ddpkit.worker.ckptfiles import shards_of
from ddpkit.worker.durable import open_regular
from ddpkit.worker.fsdp import is_sharded
from ddpkit.worker.state_dict import unwrap

__all__ = ["Parts", "check_parts", "parts", "read_shards", "write_shards"]

Parts = dict[str, list[str]]  # a sharded model's key in the state -> its optimizers' keys
_METADATA = ".metadata"


def parts(state: Mapping[str, Any]) -> Parts:
    """The sharded models in ``state`` and, for each, the optimizers over its parameters."""
    models = {
        key: unwrap(value)
        for key, value in state.items()
        if isinstance(value, nn.Module) and is_sharded(unwrap(value))
    }
    owner = {id(param): key for key, model in models.items() for param in model.parameters()}
    found: Parts = {key: [] for key in models}
    for key, value in state.items():
        if not isinstance(value, torch.optim.Optimizer):
            continue
        params = [param for group in value.param_groups for param in group["params"]]
        homes = {owner.get(id(param)) for param in params}
        if homes == {None} and not any(isinstance(param, DTensor) for param in params):
            continue  # an ordinary optimizer: saved as its state_dict()
        if len(homes) != 1 or None in homes:
            named = sorted(str(home) for home in homes if home is not None) or "not in the state"
            raise ConfigError(
                f"optimizer {key!r} steps sharded parameters of models {named} (and possibly "
                "others): it cannot be saved with exactly one of them",
                hint="put the sharded model in the state next to its optimizer, one optimizer "
                "per sharded model (or one model holding all the parameters it steps)",
            )
        found[str(homes.pop())].append(key)
    return found


def check_parts(saved: object, state: Mapping[str, Any]) -> Parts:
    """The ``sharded`` entry of a loaded payload, checked against the objects in ``state`` that
    must receive it (a module for each model, an optimizer for each of its optimizers)."""
    entries = saved.items() if isinstance(saved, dict) else None
    shaped = entries is not None and all(
        isinstance(key, str) and isinstance(keys, list) and all(isinstance(k, str) for k in keys)
        for key, keys in entries
    )
    if entries is None or not shaped:
        raise CheckpointError(
            f"the checkpoint's sharded entry {saved!r} is not ddpkit's",
            hint="load a checkpoint that ddpkit.save_checkpoint wrote",
        )
    found: Parts = {str(key): list(keys) for key, keys in entries}
    for key, optimizers in found.items():
        if not isinstance(state.get(key), nn.Module):
            raise ConfigError(
                f"the checkpoint holds the sharded model {key!r}, and state[{key!r}] is "
                f"{type(state.get(key)).__name__}",
                hint=f"pass the model as state[{key!r}] (wrapped or not: DCP reshards it)",
            )
        for name in optimizers:
            if not isinstance(state.get(name), torch.optim.Optimizer):
                raise ConfigError(
                    f"the checkpoint holds optimizer {name!r} of the sharded model {key!r}, and "
                    f"state[{name!r}] is {type(state.get(name)).__name__}",
                    hint=f"pass the optimizer over the model's parameters as state[{name!r}]",
                )
    return found


def write_shards(folder: Path, state: Mapping[str, Any], found: Parts, step: int) -> Path:
    """Every rank's shards of ``found`` in a temporary folder rank 0 made (a collective);
    returns that folder. Any rank's failure raises on every rank, and the folder is removed."""
    world_size, rank = world()
    temp: Path | None = None
    failure: Exception | None = None
    if rank == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            while temp is None:  # a hidden temporary folder of a fresh name
                drawn = folder / f".ckpt-{step:09d}-{secrets.token_hex(4)}.dcp.tmp"
                with contextlib.suppress(FileExistsError):  # drawn before: draw again
                    drawn.mkdir(mode=0o777)  # less the umask, as the checkpoint files
                    temp = drawn
        except Exception as error:
            failure = error
    name, made = broadcast(world_size, (temp and temp.name, describe(failure)))
    where = f"checkpoint step {step} in {folder}"
    hint = f"check that {folder} is a writable directory with enough free space on every rank"
    raise_failures([made], f"could not make the sharded folder of {where}", hint=hint, own=failure)
    temp = folder / name
    try:
        with _unwrapped():
            writer = FileSystemWriter(temp, sync_files=True)
            dcp_save(_state_dicts(state, found), storage_writer=writer)
    except Exception as error:  # DCP raises on every rank when one fails; shared all the same
        failure = error
    failures = all_gather(world_size, describe(failure))
    if any(failures) and rank == 0:
        shutil.rmtree(temp, ignore_errors=True)
    raise_failures(failures, f"could not write its shards of {where}", hint=hint, own=failure)
    return temp


def read_shards(path: Path, payload: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Restore the sharded models and optimizers from checkpoint ``path``'s folder (a
    collective); the targets are checked on every rank before DCP's collectives start."""
    world_size, _ = world()
    found: Parts = {}
    failure: Exception | None = None
    try:
        found = check_parts(payload["sharded"], state)
    except Exception as error:
        failure = error
    what = f"could not restore the sharded state of checkpoint step {payload['step']} from {path}"
    hint = "pass the sharded model and its optimizers under the keys they were saved with"
    raise_failures(all_gather(world_size, describe(failure)), what, hint=hint, own=failure)
    folder = shards_of(path)
    try:
        reader = _TrustedReader(folder, read_metadata(folder))  # refused before DCP reads
        target = _state_dicts(state, found)
        with _unwrapped():
            dcp_load(target, storage_reader=reader, planner=_WeightsOnlyPlanner())
        for key, optimizers in found.items():
            set_state_dict(
                unwrap(state[key]),
                [state[name] for name in optimizers],
                model_state_dict=target[key]["model"],
                optim_state_dict=target[key]["optim"],
            )
    except Exception as error:  # DCP raises on every rank when one fails; shared all the same
        failure = error
    hint = f"the folder {folder.name} next to it must be complete"
    raise_failures(all_gather(world_size, describe(failure)), what, hint=hint, own=failure)


@contextmanager
def _unwrapped() -> Iterator[None]:
    """DCP's failure as an ``Exception``: DCP gathers every rank's failure into one
    ``CheckpointException``, a ``BaseException`` that ``except Exception`` would let through;
    ddpkit's own error (a refusal) comes out as it was raised, any other as CheckpointError."""
    try:
        with warnings.catch_warnings():
            # without a process group DCP reads and writes as one process, and says so
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            yield
    except CheckpointException as error:
        ranks = sorted(error.failures)
        first, _ = error.failures[ranks[0]]
        if isinstance(first, DdpkitError):
            raise first from None
        text = str(first).splitlines()[0] if str(first) else ""
        raise CheckpointError(
            f"torch.distributed.checkpoint failed on ranks {ranks}: {type(first).__name__}: {text}",
            hint="check that every rank sees the same checkpoint folder, writable, with space",
        ) from first


def _state_dicts(state: Mapping[str, Any], found: Parts) -> dict[str, Any]:
    every: dict[str, Any] = {}
    for key, optimizers in found.items():
        model, optim = get_state_dict(unwrap(state[key]), [state[name] for name in optimizers])
        every[key] = {"model": model, "optim": optim}
    return every


class _TrustedReader(FileSystemReader):
    """DCP's file reader, given the metadata :func:`read_metadata` read (DCP's own reader
    would unpickle it unrestricted; a refusal raised inside DCP's load would reach the
    caller as DCP's own, less telling, error)."""

    def __init__(self, folder: Path, metadata: Metadata) -> None:
        super().__init__(folder)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata: DCP without coordination
            raise CheckpointError(
                "a sharded checkpoint is read with per-rank metadata, which ddpkit never writes",
                hint="load a checkpoint that ddpkit.save_checkpoint wrote",
            )
        metadata = self._metadata
        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id  # what DCP's own reader does
        metadata.storage_meta = storage
        return metadata


def read_metadata(folder: Path) -> Metadata:
    """``folder``'s DCP metadata, unpickled weights-only; CheckpointError naming any global it
    refuses, and any file named outside the folder."""
    path = folder / _METADATA
    with open_regular(path) as file:
        try:
            metadata = _MetadataUnpickler(file).load()
        except _Refused as refused:
            raise CheckpointError(
                f"{path} names {refused.args[0]}, which ddpkit does not unpickle: DCP's metadata "
                "holds only its own dataclasses, and unpickling anything else can run code",
                hint=f"remove {folder} (it was not written by ddpkit.save_checkpoint); the "
                "previous checkpoint loads instead when you pass the folder",
            ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not DCP metadata",
            hint=f"remove {folder}: it was not written by ddpkit.save_checkpoint",
        )
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in {"", ".", ".."} or "/" in name or "\\" in name:
            raise CheckpointError(
                f"{path} names the file {name!r}, outside its folder",
                hint=f"remove {folder}: it was not written by ddpkit.save_checkpoint",
            )
    return metadata


class _Refused(pickle.UnpicklingError):
    """A global the metadata unpickler does not build."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch.Size and dtypes; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in compat.DCP_METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {pid!r}")


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, with each non-tensor value loaded ``weights_only`` first."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                f"a value of the sharded checkpoint ({read_item.dest_index.fqn}) is refused by "
                f"a weights-only load: {str(error).splitlines()[0]}",
                hint="remove the checkpoint: ddpkit writes only numbers, strings and containers "
                "there",
            ) from None
        mine = io.BytesIO()
        torch.save(loaded, mine)  # what DCP unpickles below is ddpkit's own pickle of it
        mine.seek(0)
        super().load_bytes(read_item, mine)
