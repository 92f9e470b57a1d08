"""Checkpoints that survive being killed mid-write: ``save_checkpoint`` / ``load_checkpoint``.

Layout: ``<directory>/ckpt-<step:09d>-<sequence:09d>[-<run id>-a<attempt>].pt``, one file per
checkpoint, written only by the main rank. A write goes to a hidden temporary file in the same
directory (``.<name>.<token>.hb.tmp``, created with mode 0666 less the umask,
like any file ``torch.save`` creates), is flushed and fsynced, then ``os.replace``\\ d onto its
final name and the directory fsynced: a reader sees either the whole new file or none of it,
and a ``kill -9`` during the write leaves the previous checkpoints untouched. The temporary
file a killed writer leaves is removed by a later save, before it writes, once it has not been
touched for minutes (so that it cannot fill the disk for good), and never looked at by a load;
a live writer's (another job sharing the folder) is left alone: it touches its file while it
writes (:mod:`ddpkit.worker.durable`).

Order: the newest checkpoint is the one written last, not the one with the highest step. Each
file's name holds its save's ``sequence`` (one more than the highest in the directory when it
was written), and load, prune and save all go by it: a run restarted from scratch in a used folder,
a resume from an older checkpoint after the newest was damaged, or a fine-tune that resets the
step resumes from its own latest save, and ``keep_last`` keeps the latest saves, never deleting
the file just written in favour of an older run's higher step (the save warns when the
directory holds such higher steps). The name also holds the run id and attempt that wrote the
file (``checkpoint_origin``); names and their older form are read by
:mod:`ddpkit.worker.ckptfiles`, which never opens a file. A file that does not load (damaged,
or not written here) is skipped by a folder's load with a warning.

Values with ``state_dict()`` are stored as their state dict. ``DistributedDataParallel``,
``DataParallel`` and ``torch.compile`` wrappers are unwrapped first
(:func:`ddpkit.worker.state_dict.unwrap`), so a checkpoint holds the bare model's keys (no
``module.`` or ``_orig_mod.`` prefix); a module is restored with
:func:`ddpkit.worker.state_dict.load_state_dict`, which matches keys with the prefixes removed
on both sides: a checkpoint saved under single, dp, ddp or a compiled model loads into any
of them, also one whose state was saved with the prefixes (by an older save or by hand). Every
rank's RNG states (python, numpy when installed, torch CPU, torch CUDA when available) are
gathered to the main rank and saved, and each rank gets its own back on load; a load at another
world size re-seeds each rank instead, deterministically from the saved states, the step, the
new world size and the rank (the saved streams belong to ranks that no longer exist; the
loader's position is remapped, see :mod:`ddpkit.worker.reshard`). Ranks are the
process group's (:func:`ddpkit.worker.context.current_or_none`), whether ``ddpkit.init()`` or plain
``torch.distributed`` created it.

Trust: a folder may hold files someone else put there. Saving never unpickles anything; a load
unpickles only the checkpoint it restores, with ``torch.load(weights_only=True)`` and an
allow-list of what ddpkit stores (:mod:`ddpkit.worker.safeload`); other types in the user's own
state load only when passed as ``trusted_types``. ``load_checkpoint`` also takes one checkpoint
file instead of a folder, and then loads exactly that file or raises.

Failures are shared, never left to a collective timeout: a rank whose ``state_dict()`` raises,
a main rank that cannot write (directory, permissions, space, a value that cannot be pickled)
and a rank whose ``load_state_dict`` raises make every rank raise :class:`CheckpointError`
naming the step, the directory, the rank and the cause (the failing rank chains the original);
the process group stays usable and nothing half-written is left behind.

Sharded state: a model sharded by ``wrap(model, "fsdp")`` and the optimizers over its
parameters are written by every rank through torch.distributed.checkpoint into a folder next
to the file, ``ckpt-<...>.dcp``, which is complete before the file is written; a load reads it
at any world size, its pickled metadata weights-only (:mod:`ddpkit.worker.sharded`).

In the background: :mod:`ddpkit.worker.asyncsave` runs the first half of a save
(:func:`collect`) in the loop and the second (:func:`save_payload`) in a thread, on a copy.

Write speed: the file is written through a stream that asks the kernel to start writing each
16 MB back to disk as soon as it is written (``sync_file_range``), so the fsync that makes the
file durable waits for the tail only; and the page cache of the checkpoints this save will
prune is released before the write instead of after it, so the write can reuse those pages (on
a VM whose free memory goes back to the host, fresh pages cost a host fault each). Neither
skips work: the fsync before the rename stays.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ddpkit.cluster.runid import run_identity
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.worker import ckptfiles, inflight, sharded
from ddpkit.worker.agree import _Failure, all_gather, broadcast, describe, raise_failures, world
from ddpkit.worker.context import current_or_none
from ddpkit.worker.durable import drop_cache, write_atomically
from ddpkit.worker.precision import restore_scalers, scalers
from ddpkit.worker.safeload import check_trusted, read_checkpoint
from ddpkit.worker.shardio import read_shards, sharded_keys, write_shards
from ddpkit.worker.state_dict import load_state_dict, unwrap
from ddpkit.worker.watchdog.flight import patient

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

_FORMAT = 3  # 3: the write order and the origin are in the file's name (2: in the pickle)
_SHARDED_FORMAT = 4  # 3 with a sharded folder next to the file (older ddpkits refuse it)


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
    found = sharded.parts(state)  # the FSDP2 models and their optimizers: saved by every rank
    rest = {key: value for key, value in state.items() if key not in sharded_keys(found)}
    payload = collect(directory, rest, step=step, keep_last=keep_last)  # after any pending
    shards = write_shards(Path(directory), state, found, step) if found else None
    path: Path | None = None
    failure: Exception | None = None
    if rank == 0:
        try:
            payload = {**payload, "sharded": found} if found else payload
            path = save_payload(Path(directory), payload, step, keep_last, shards=shards)
        except Exception as error:
            failure = error
            if shards is not None:
                sharded.discard(shards)
    # Instead of a bare barrier: nobody moves on (or loads) before the file is in place, and
    # everybody learns whether it is.
    outcome: _Failure = broadcast(world_size, describe(failure))
    if outcome is not None:
        text, hint = outcome
        raise CheckpointError(
            f"the main rank (rank 0) failed to write checkpoint step {step} to {directory}: {text}",
            hint=hint
            or f"check that {directory} is (or can be created as) a writable directory with "
            "enough free space, and that every value in the state can be pickled; the "
            "checkpoints already there are untouched",
        ) from failure
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
    if sharded.parts(state):  # save_checkpoint passes the rest only
        raise ConfigError(
            f"sharded (FSDP2) state in {sorted(sharded.parts(state))} cannot be saved in the "
            "background",
            hint="use ddpkit.save_checkpoint for a model wrapped with strategy='fsdp'",
        )
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
    payload: dict[str, Any] | None = None
    failure: Exception | None = None
    read: tuple[Path, dict[str, Any]] | None = None
    try:
        read = read_checkpoint(Path(directory), map_location, trusted)
    except Exception as error:  # e.g. a directory this rank cannot list
        failure = error
    payload = read[1] if read is not None else None
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
    if payload is None:
        return None
    step: int = payload["step"]
    if "sharded" in payload:  # the same file on every rank: all of them take this branch
        read_shards(read[0] if read is not None else Path(directory), payload, state)
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
    """The run id and attempt that write this checkpoint (see :mod:`ddpkit.cluster.runid`),
    which its file's name holds (and the payload too, for whoever reads a renamed file); none
    without a context whose run the environment names."""
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
    else:  # the folder first: a checkpoint whose file exists is complete
        sharded.commit(shards, ckptfiles.shards_of(folder / name))
        try:
            path = write_atomically(folder, name, {"format": _SHARDED_FORMAT, **payload})
        except BaseException:
            sharded.discard(ckptfiles.shards_of(folder / name))
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
    """Prune; a failure only warns: the new checkpoint is complete, and raising here (on the
    main rank alone) would leave the other ranks waiting for it."""
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
        _seed_all(seed)
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
    """The seed of ``rank`` when a checkpoint of another world size loads: a digest of every
    saved rank's torch RNG state (so it follows the run's own seeds), the step, the new world
    size and the rank; the same resume gives the same seeds, and every rank its own."""
    digest = hashlib.blake2b(f"{step}:{world_size}:{rank}".encode(), digest_size=4)
    for state in saved:
        digest.update(state["torch"].cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "big")


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also every CUDA device's generator
    try:
        import numpy
    except ImportError:  # numpy is optional
        return
    numpy.random.seed(seed)
