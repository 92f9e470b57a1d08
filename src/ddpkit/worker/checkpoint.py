"""Checkpoints that survive being killed mid-write: ``save_checkpoint`` / ``load_checkpoint``.

One file per checkpoint, ``<directory>/ckpt-<step:09d>-<sequence:09d>[-<run id>-a<attempt>].pt``
(:mod:`ddpkit.worker.ckptfiles`, which reads names and never opens a file), written by the main
rank alone and atomically (:mod:`ddpkit.worker.durable`: a ``kill -9`` mid-write leaves the
previous checkpoints untouched). FSDP2 state is written by every rank into a ``.dcp`` folder
next to it, complete before the file is (:mod:`ddpkit.worker.sharded`).

The newest checkpoint is the one written last, not the one with the highest step, so that a
run restarted in a used folder, or a fine-tune that resets the step, resumes from its own
latest save and ``keep_last`` never deletes the file just written (the save warns of higher
steps).

Values with ``state_dict()`` are stored as their state dict, models unwrapped first
(:mod:`ddpkit.worker.state_dict`: any mode loads into any other). Every rank gets its own RNG
states back; a load at another world size re-seeds each rank deterministically instead (the
saved streams belong to ranks that no longer exist). Saving never unpickles; a load unpickles
only the checkpoint it restores, weights-only with an allow-list
(:mod:`ddpkit.worker.safeload`).

Failures are shared, never left to a collective timeout: a failing ``state_dict()``, write or
``load_state_dict`` makes every rank raise :class:`CheckpointError`. :mod:`ddpkit.worker.asyncsave`
runs :func:`collect` in the loop and :func:`save_payload` in a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import sys
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ddpkit.cluster.runid import run_identity
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.worker import ckptfiles, inflight
from ddpkit.worker.agree import _Failure, all_gather, broadcast, describe, raise_failures, world
from ddpkit.worker.context import current_or_none
from ddpkit.worker.durable import drop_cache, fsync_directory, write_atomically
from ddpkit.worker.precision import restore_scalers, scalers
from ddpkit.worker.rankzero import seed_everything
from ddpkit.worker.safeload import check_trusted, read_checkpoint
from ddpkit.worker.state_dict import load_state_dict, unwrap
from ddpkit.worker.watchdog.flight import patient

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

_FORMAT = 3  # 3: the write order and the origin are in the file's name (2: in the pickle)
_SHARDED_FORMAT = 4  # 3 with a sharded folder next to the file (older ddpkits refuse it)
# A sharded model is an FSDPModule (torch.distributed.fsdp) or has DTensor parameters
# (torch.distributed.tensor): without either imported no value is one, and a plain save or load
# never imports :mod:`ddpkit.worker.sharded` (torch.distributed.checkpoint: a CPU second).
_SHARDING_MODULES = ("torch.distributed.fsdp", "torch.distributed.tensor")


@patient()  # its waits are for disk writes and copies, maybe minutes: not hangs
def save_checkpoint(
    directory: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    step: int,
    keep_last: int = 3,
) -> Path | None:
    """Save ``state`` as checkpoint ``step``; call it on every rank (it is a collective).

    Returns the file's path on the main rank, None on the others. Keeps the ``keep_last``
    complete checkpoints written last (this one included, whatever the others' steps) and
    deletes the others and the temporary files of dead writers.
    When a rank's ``state_dict()`` raises or the main rank cannot write the file, every rank
    raises :class:`CheckpointError` (the checkpoints already there stay as they were). A
    checkpoint still written in the background (:func:`ddpkit.async_save_checkpoint`) is
    waited for first, and its failure raised here.
    """
    world_size, rank = world()
    found = sharded_parts(state)  # the FSDP2 models and their optimizers: saved by every rank
    keys = {key for model, optimizers in found.items() for key in (model, *optimizers)}
    rest = {key: value for key, value in state.items() if key not in keys}
    payload = collect(directory, rest, step=step, keep_last=keep_last)  # after any pending
    shards = None
    if found:
        from ddpkit.worker import sharded

        shards = sharded.write_shards(Path(directory), state, found, step)
    path: Path | None = None
    failure: Exception | None = None
    if rank == 0:
        try:
            payload = {**payload, "sharded": found} if found else payload
            path = save_payload(Path(directory), payload, step, keep_last, shards=shards)
        except Exception as error:
            failure = error
            if shards is not None:
                shutil.rmtree(shards, ignore_errors=True)
    # Instead of a bare barrier: nobody moves on (or loads) before the file is in place, and
    # everybody learns whether it is.
    outcome: _Failure = broadcast(world_size, describe(failure))
    if outcome is not None:
        raise inflight.write_failed(step, directory, *outcome) from failure
    return path


def collect(
    directory: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    step: int,
    keep_last: int,
) -> dict[str, Any]:
    """The first half of a save, on every rank (a collective): check the arguments, end the
    save in flight (:mod:`ddpkit.worker.inflight`), take every value's state and gather the
    RNG states. Returns the payload to write on the main rank, {} on the others."""
    _check_count("step", step, minimum=0, hint="pass the global training step, e.g. step=1000")
    _check_count("keep_last", keep_last, minimum=1, hint="keep at least one checkpoint")
    world_size, rank = world()
    inflight.finish(world_size)  # at most one write in flight, and numbered after the last
    saved: dict[str, Any] = {}
    mine: dict[str, Any] | None = None
    failure: Exception | None = None
    try:
        # state_dict() on every rank: for sharded wrappers it is itself a collective.
        saved = {key: _saveable(value) for key, value in state.items()}
        mine = _rng_state()
    except Exception as error:  # shared below: the other ranks must not wait for this one
        failure = error
    gathered = all_gather(world_size, (mine, describe(failure)))
    raise_failures(
        [text for _, text in gathered],
        f"could not collect its state for checkpoint step {step} in {directory}",
        hint="every value's state_dict() must succeed on every rank",
        own=failure,
    )
    if rank != 0:
        return {}
    payload = {"step": step, "world_size": world_size, **_run_stamp(), "state": saved}
    payload["scalers"] = scalers(state)  # fp16 loss scales of the models, by state key
    payload["rng"] = [rng for rng, _ in gathered]
    return payload


@patient()  # its waits are for disk reads, maybe minutes: not hangs
def load_checkpoint(
    directory: str | os.PathLike[str],
    state: MutableMapping[str, Any],
    *,
    map_location: str | torch.device | None = None,
    trusted_types: Sequence[Any] = (),
) -> int | None:
    """Restore ``state`` in place from the newest complete checkpoint; return its step.

    ``directory`` is the folder ``save_checkpoint`` writes to. The newest is the one written
    last, which need not have the highest step (a run restarted in a used folder). A file that
    fails to load (truncated, corrupt) is skipped with a warning and the previous one is tried.
    Returns None, leaving ``state`` untouched, when the folder holds no loadable checkpoint or
    does not exist yet (a fresh run). ``directory`` may instead be one checkpoint file: then
    exactly that file is loaded, and a file that cannot be is an error (as is a missing path
    named like a checkpoint file, ``*.pt``). Call it on every rank.

    Files are read with ``torch.load(weights_only=True)``: tensors, numbers, strings,
    containers and what ddpkit itself stores load; a checkpoint that holds any other type (your
    own classes in ``state``) raises :class:`CheckpointError` naming it, unless you pass the
    types in ``trusted_types`` (e.g. ``[MyConfig]``), which you should only do for files you
    trust. When one rank cannot read the checkpoint or restore its objects
    (``load_state_dict`` raising), every rank raises :class:`CheckpointError`, so that none
    trains on from a partial restore.
    """
    trusted = check_trusted(trusted_types)
    world_size, rank = world()
    inflight.finish(world_size)  # a checkpoint written in the background is in place first
    if map_location is None:
        context = current_or_none()
        map_location = context.device if context is not None else torch.device("cpu")
    failure: Exception | None = None
    read: tuple[Path, dict[str, Any]] | None = None
    try:
        read = read_checkpoint(Path(directory), map_location, trusted)
    except Exception as error:  # e.g. a directory this rank cannot list
        failure = error
    name = read[0].name if read is not None else None  # what every rank must have found alike
    found = all_gather(world_size, (name, describe(failure)))
    raise_failures(
        [text for _, text in found],
        f"could not read the checkpoints in {directory}",
        hint="every rank must be able to read the checkpoint directory",
        own=failure,
    )
    newest = [identity for identity, _ in found]
    if len(set(newest)) > 1:
        raise ConfigError(
            f"ranks found different newest checkpoints in {directory}: the file by rank {newest}",
            hint="every rank must see the same checkpoint directory (a shared filesystem)",
        )
    if read is None:
        return None
    path, payload = read
    step: int = payload["step"]
    if "sharded" in payload:  # the same file on every rank: all of them take this branch
        from ddpkit.worker import sharded

        sharded.read_shards(path, payload, state)
    try:
        _restore(payload["state"], state)
        restore_scalers(payload.get("scalers", {}), state)
    except Exception as error:  # shared below: no rank may train on from a partial restore
        failure = error
    raise_failures(
        all_gather(world_size, describe(failure)),
        f"could not restore checkpoint step {step} from {directory}",
        hint="every rank must pass objects that match the checkpoint (the model, optimizer "
        "and loader of the run that saved it)",
        own=failure,
    )
    _restore_rng(payload, world_size, rank)
    return step


def sharded_parts(state: Mapping[str, Any]) -> dict[str, list[str]]:
    """The sharded models in ``state`` and the optimizers of each
    (:func:`ddpkit.worker.sharded.parts`); {} at once where no value can be sharded."""
    if not any(name in sys.modules for name in _SHARDING_MODULES):
        return {}
    from ddpkit.worker import sharded

    return sharded.parts(state)


def checkpoint_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest written first (temporary files
    excluded; one named by an older ddpkit counts as older than the others)."""
    return [entry.path for entry in ckptfiles.written(Path(directory))]


def _restore(saved: Mapping[str, Any], state: MutableMapping[str, Any]) -> None:
    for key, value in saved.items():
        target = state.get(key)
        if isinstance(target, torch.nn.Module):
            load_state_dict(target, value)
        elif target is not None and hasattr(target, "load_state_dict"):
            target.load_state_dict(value)
        else:
            state[key] = value


def _run_stamp() -> dict[str, Any]:
    """The run id and attempt for the file's name and payload; none when no run is named."""
    context = current_or_none()
    run = context.run if context is not None else run_identity(os.environ)
    if run.source == "fresh" and context is None:
        return {}  # a fresh id per save would name no run
    return {"run_id": run.run_id, "attempt": run.attempt}


def _check_count(name: str, value: object, *, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}", hint=hint)


def _saveable(value: Any) -> Any:
    if isinstance(value, torch.nn.Module):
        value = unwrap(value)
    return value.state_dict() if hasattr(value, "state_dict") else value


def save_payload(
    folder: Path, payload: dict[str, Any], step: int, keep_last: int, *, shards: Path | None = None
) -> Path:
    """Write ``payload`` as checkpoint ``step``, the newest in ``folder``; prune the others.
    ``shards``: the temporary folder of its sharded state, renamed into place first."""
    folder.mkdir(parents=True, exist_ok=True)
    # A dead writer's temporary file must not take the space this write needs; a failure
    # here is tried again (and warned of) by the prune after the write.
    with contextlib.suppress(OSError):
        ckptfiles.remove_stale_temps(folder)
    found = ckptfiles.written(folder)
    sequence = ckptfiles.next_sequence(folder, found)
    doomed = ckptfiles.doomed(found, step, keep_last)
    drop_cache([entry.path for entry in doomed])
    run = (payload["run_id"], payload["attempt"]) if "run_id" in payload else None
    name = ckptfiles.file_name(step, sequence, run)
    if shards is None:
        path = write_atomically(folder, name, {"format": _FORMAT, **payload})
    else:  # the folder first, durably: a checkpoint whose file exists is complete
        os.replace(shards, ckptfiles.shards_of(folder / name))
        fsync_directory(folder)
        try:
            path = write_atomically(folder, name, {"format": _SHARDED_FORMAT, **payload})
        except BaseException:
            shutil.rmtree(ckptfiles.shards_of(folder / name), ignore_errors=True)
            raise
    # The older files of the same step go once this one, newer, is in place.
    _prune_or_warn(folder, [entry.path for entry in doomed], step)
    _warn_higher_steps(folder, found, step)
    return path


def _warn_higher_steps(folder: Path, found: list[ckptfiles.Found], step: int) -> None:
    """Say so when older saves have higher steps: the user may have meant another folder."""
    higher = sorted(entry.step for entry in found if entry.step > step)
    if higher:
        warnings.warn(
            f"checkpoint step {step} is saved in {folder}, which holds checkpoints of higher "
            f"steps {higher} written before it (a run restarted or a step reset in a used "
            f"folder?): step {step} is the newest, load_checkpoint resumes from it and "
            "keep_last prunes the older saves first; use a fresh directory per run to keep them",
            RuntimeWarning,
            stacklevel=4,
        )


def _prune_or_warn(folder: Path, doomed: list[Path], step: int) -> None:
    """Prune; a failure only warns: raising on the main rank alone would strand the others."""
    try:
        ckptfiles.prune(folder, doomed)
    except Exception as error:
        warnings.warn(
            f"checkpoint step {step} is saved in {folder}, but older files could not be "
            f"deleted ({type(error).__name__}: {error}); they will be tried again next save",
            RuntimeWarning,
            stacklevel=4,
        )


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


def _restore_rng(payload: Mapping[str, Any], world_size: int, rank: int) -> None:
    saved = payload["rng"]
    if len(saved) != world_size:
        seed = _resized_seed(saved, payload["step"], world_size, rank)
        warnings.warn(
            f"checkpoint step {payload['step']} was saved by {len(saved)} ranks, this job has "
            f"{world_size}: each rank's RNGs (python, numpy, torch) are re-seeded from the "
            f"checkpoint and the rank, not restored (this rank: seed {seed})",
            RuntimeWarning,
            stacklevel=3,
        )
        seed_everything(seed, per_rank=False)  # every RNG the save holds
        return
    mine = saved[rank]
    random.setstate(mine["python"])
    torch.set_rng_state(mine["torch"].cpu())
    if "numpy" in mine:
        import numpy

        numpy.random.set_state(mine["numpy"])
    if "cuda" in mine and torch.cuda.is_available():  # not exercised by the CPU-only suite
        torch.cuda.set_rng_state_all([state.cpu() for state in mine["cuda"]])


def _resized_seed(saved: Sequence[Mapping[str, Any]], step: int, world_size: int, rank: int) -> int:
    """The seed of ``rank`` when a checkpoint of another world size loads: a digest of the
    saved torch RNG states, the step, the new world size and the rank (reproducible, per rank)."""
    digest = hashlib.blake2b(f"{step}:{world_size}:{rank}".encode(), digest_size=4)
    for state in saved:
        digest.update(state["torch"].cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "big")
