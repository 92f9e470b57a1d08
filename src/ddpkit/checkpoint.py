"""Checkpoints that survive being killed mid-write: ``save_checkpoint`` / ``load_checkpoint``.

Layout: ``<directory>/ckpt-<step:09d>.pt``, one file per checkpoint, written only by the main
rank. A write goes to a hidden temporary file in the same directory (``.ckpt-<step>.*.tmp``),
is flushed and fsynced, then ``os.replace``\\ d onto its final name and the directory fsynced:
a reader sees either the whole new file or none of it, and a ``kill -9`` during the write
leaves the previous checkpoints untouched (the stray temporary file is removed by the next
save and never looked at by a load).

Values with ``state_dict()`` are stored as their state dict. ``DistributedDataParallel`` and
``DataParallel`` are unwrapped first (their ``.module``), so a checkpoint holds the bare
model's keys (no ``module.`` prefix) and loads into a wrapped or a bare model alike. Every
rank's RNG states (python, numpy when installed, torch CPU, torch CUDA when available) are
gathered to the main rank and saved, and each rank gets its own back on load.

Files are read with ``torch.load(weights_only=False)``: they are the job's own files and hold
arbitrary picklable values; do not load checkpoints from untrusted sources.
"""

from __future__ import annotations

import os
import random
import re
import tempfile
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.runtime import current_or_none

__all__ = ["load_checkpoint", "save_checkpoint"]

_FORMAT = 1
_COMPLETE = re.compile(r"^ckpt-(\d{9,})\.pt$")
_TEMP = re.compile(r"^\.ckpt-.*\.tmp$")


def save_checkpoint(
    directory: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    step: int,
    keep_last: int = 3,
) -> Path | None:
    """Save ``state`` as checkpoint ``step``; call it on every rank (it is a collective).

    Returns the file's path on the main rank, None on the others. Keeps the newest
    ``keep_last`` complete checkpoints and deletes older ones and stray temporary files.
    """
    _check_count("step", step, minimum=0, hint="pass the global training step, e.g. step=1000")
    _check_count("keep_last", keep_last, minimum=1, hint="keep at least one checkpoint")
    world_size, rank = _world()
    # state_dict() on every rank: for sharded wrappers it is itself a collective.
    saved = {key: _saveable(value) for key, value in state.items()}
    rng = _gather_rng(world_size)
    path: Path | None = None
    if rank == 0:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": _FORMAT,
            "step": step,
            "world_size": world_size,
            "state": saved,
            "rng": rng,
        }
        path = _write_atomically(folder, f"ckpt-{step:09d}.pt", payload)
        _prune(folder, keep_last)
    if world_size > 1:
        dist.barrier()  # nobody moves on (or loads) before the file is in place
    return path


def load_checkpoint(
    directory: str | os.PathLike[str],
    state: MutableMapping[str, Any],
    *,
    map_location: str | torch.device | None = None,
) -> int | None:
    """Restore ``state`` in place from the newest complete checkpoint; return its step.

    Call it on every rank. A file that fails to load (truncated, corrupt) is skipped with a
    warning and the previous one is tried. Returns None, leaving ``state`` untouched, when
    ``directory`` holds no loadable checkpoint.
    """
    world_size, rank = _world()
    if map_location is None:
        context = current_or_none()
        map_location = context.device if context is not None else torch.device("cpu")
    payload = _load_newest(Path(directory), map_location)
    steps = [None if payload is None else payload["step"]] * world_size
    if world_size > 1:
        dist.all_gather_object(steps, steps[rank])
    if len(set(steps)) > 1:
        raise ConfigError(
            f"ranks found different newest checkpoints in {directory}: steps by rank {steps}",
            hint="every rank must see the same checkpoint directory (a shared filesystem)",
        )
    if payload is None:
        return None
    for key, value in payload["state"].items():
        target = state.get(key)
        if hasattr(target, "load_state_dict"):
            _unwrap(target).load_state_dict(value)
        else:
            state[key] = value
    _restore_rng(payload, world_size, rank)
    step: int = payload["step"]
    return step


def checkpoint_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest first (temporary files excluded)."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = [
        (int(match.group(1)), entry)
        for entry in folder.iterdir()
        if (match := _COMPLETE.match(entry.name)) is not None and entry.is_file()
    ]
    return [path for _, path in sorted(found)]


def _world() -> tuple[int, int]:
    context = current_or_none()
    if context is None or context.world_size == 1 or not dist.is_initialized():
        return 1, 0
    return context.world_size, context.rank


def _check_count(name: str, value: object, *, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}", hint=hint)


def _unwrap(value: Any) -> Any:
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return value.module if isinstance(value, wrappers) else value


def _saveable(value: Any) -> Any:
    value = _unwrap(value)
    return value.state_dict() if hasattr(value, "state_dict") else value


def _write_atomically(folder: Path, name: str, payload: Any) -> Path:
    handle, temp_name = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    os.close(handle)
    temp = Path(temp_name)
    try:
        # torch.save to a path uses its C++ file writer (faster than through a Python file).
        torch.save(payload, temp)
        with open(temp, "rb+") as written:
            os.fsync(written.fileno())
        final = folder / name
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(folder)  # make the rename itself durable
    return final


def _fsync_directory(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _prune(folder: Path, keep_last: int) -> None:
    complete = checkpoint_files(folder)
    for old in complete[:-keep_last]:
        old.unlink(missing_ok=True)
    # Only the main rank writes here and its own temporary file is renamed by now: any
    # other one was left by a writer that was killed.
    for entry in folder.iterdir():
        if _TEMP.match(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)


def _load_newest(folder: Path, map_location: str | torch.device) -> dict[str, Any] | None:
    for path in reversed(checkpoint_files(folder)):
        try:
            payload = torch.load(path, map_location=map_location, weights_only=False)
        except Exception as error:  # any unreadable file: fall back to the previous one
            warnings.warn(
                f"skipping checkpoint {path}: it cannot be loaded ({type(error).__name__}: "
                f"{error}); trying the previous one",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        if isinstance(payload, dict) and payload.get("format") == _FORMAT:
            return payload
        warnings.warn(
            f"skipping checkpoint {path}: not written by ddpkit.save_checkpoint",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy
    except ImportError:  # numpy is optional
        pass
    else:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available():  # not exercised by the CPU-only test suite
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _gather_rng(world_size: int) -> list[dict[str, Any]]:
    mine = _rng_state()
    if world_size == 1:
        return [mine]
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    return every


def _restore_rng(payload: Mapping[str, Any], world_size: int, rank: int) -> None:
    saved = payload["rng"]
    if len(saved) != world_size:
        warnings.warn(
            f"checkpoint step {payload['step']} was saved by {len(saved)} ranks, this job has "
            f"{world_size}: the RNG states are not restored",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    mine = saved[rank]
    random.setstate(mine["python"])
    torch.set_rng_state(mine["torch"].cpu())
    if "numpy" in mine:
        import numpy

        numpy.random.set_state(mine["numpy"])
    if "cuda" in mine and torch.cuda.is_available():  # not exercised by the CPU-only suite
        torch.cuda.set_rng_state_all([state.cpu() for state in mine["cuda"]])
