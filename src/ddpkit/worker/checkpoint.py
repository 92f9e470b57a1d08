"""Checkpoints that survive being killed mid-write: ``save_checkpoint`` / ``load_checkpoint``.

Layout: ``<directory>/ckpt-<step:09d>.pt``, one file per checkpoint, written only by the main
rank. A write goes to a hidden temporary file in the same directory
(``.ckpt-<step>.pt.<host>~<scope>.<pid>.<token>.tmp``, created with mode 0666 less the umask,
like any file ``torch.save`` creates), is flushed and fsynced, then ``os.replace``\\ d onto its
final name and the directory fsynced: a reader sees either the whole new file or none of it,
and a ``kill -9`` during the write leaves the previous checkpoints untouched. The temporary
file a killed writer leaves is removed by the next save, before it writes (so that it cannot
fill the disk for good) and never looked at by a load; a live writer's (another job sharing
the folder) is left alone (:mod:`ddpkit.worker.durable` says how the two are told apart).

Order: the newest checkpoint is the one written last, not the one with the highest step. Each
file records its save's ``sequence`` (one more than the highest in the directory when it was
written), and load, prune and save all go by it: a run restarted from scratch in a used folder,
a resume from an older checkpoint after the newest was damaged, or a fine-tune that resets the
step resumes from its own latest save, and ``keep_last`` keeps the latest saves, never deleting
the file just written in favour of an older run's higher step (the save warns when the
directory holds such higher steps). Reading a file's sequence costs an mmap-ed ``torch.load``
(the pickle, not the tensor data). A file whose sequence cannot be read (damaged, or not
written here) counts as the oldest: a load skips it with a warning, a save prunes it first.
Files of format 1 (before the sequence) count as older than any later save, by step among
themselves.

Values with ``state_dict()`` are stored as their state dict. ``DistributedDataParallel``,
``DataParallel`` and ``torch.compile`` wrappers are unwrapped first
(:func:`ddpkit.worker.state_dict.unwrap`), so a checkpoint holds the bare model's keys (no
``module.`` or ``_orig_mod.`` prefix); a module is restored with
:func:`ddpkit.worker.state_dict.load_state_dict`, which matches keys with the prefixes removed
on both sides: a checkpoint saved under single, dp, ddp or a compiled model loads into any
of them, also one whose state was saved with the prefixes (by an older save or by hand). Every
rank's RNG states (python, numpy when installed, torch CPU, torch CUDA when available) are
gathered to the main rank and saved, and each rank gets its own back on load. Ranks are the
process group's (:func:`ddpkit.worker.context.current_or_none`), whether ``ddpkit.init()`` or plain
``torch.distributed`` created it.

Failures are shared, never left to a collective timeout: a rank whose ``state_dict()`` raises,
a main rank that cannot write (directory, permissions, space, a value that cannot be pickled)
and a rank whose ``load_state_dict`` raises make every rank raise :class:`CheckpointError`
naming the step, the directory, the rank and the cause (the failing rank chains the original);
the process group stays usable and nothing half-written is left behind.

Files are read with ``torch.load(weights_only=False)``: they are the job's own files and hold
arbitrary picklable values; do not load checkpoints from untrusted sources.

Write speed: the file is written through :class:`_StreamingFile`, which asks the kernel to start
writing each 16 MB back to disk as soon as it is written (``sync_file_range``), so the fsync
that makes the file durable waits for the tail only; and the page cache of the checkpoints
this save will prune is released before the write instead of after it, so the write can reuse
those pages (on a VM whose free memory goes back to the host, fresh pages cost a host fault
each). Neither skips work: the fsync before the rename stays.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ddpkit.errors import CheckpointError, ConfigError, DdpkitError
from ddpkit.worker.context import current_or_none
from ddpkit.worker.durable import drop_cache, stale_temps, write_atomically
from ddpkit.worker.state_dict import load_state_dict, unwrap

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

_FORMAT = 2  # 2: the payload records "sequence", the save's place in the write order
_READABLE = (1, 2)  # format 1 has no sequence: older than every format-2 save
# used with fullmatch: "$" also matches before a final newline ("ckpt-000000001.pt\n")
_COMPLETE = re.compile(r"ckpt-(\d{9,})\.pt")
_TEMP_PREFIX = "ckpt-"  # temporary files are ".ckpt-<step>.pt.<writer>.tmp"
# what a failure becomes to share it between ranks: its text and its own hint, or None
_Failure = tuple[str, str | None] | None


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
    raises :class:`CheckpointError` (the checkpoints already there stay as they were).
    """
    _check_count("step", step, minimum=0, hint="pass the global training step, e.g. step=1000")
    _check_count("keep_last", keep_last, minimum=1, hint="keep at least one checkpoint")
    world_size, rank = _world()
    saved: dict[str, Any] = {}
    mine: dict[str, Any] | None = None
    failure: Exception | None = None
    try:
        # state_dict() on every rank: for sharded wrappers it is itself a collective.
        saved = {key: _saveable(value) for key, value in state.items()}
        mine = _rng_state()
    except Exception as error:  # shared below: the other ranks must not wait for this one
        failure = error
    gathered = _all_gather(world_size, (mine, _describe(failure)))
    _raise_failures(
        [text for _, text in gathered],
        f"could not collect its state for checkpoint step {step} in {directory}",
        hint="every value's state_dict() must succeed on every rank",
        own=failure,
    )
    path: Path | None = None
    if rank == 0:
        rngs = [rng for rng, _ in gathered]
        payload = {"step": step, "world_size": world_size, "state": saved, "rng": rngs}
        try:
            path = _save(Path(directory), payload, step, keep_last)
        except Exception as error:
            failure = error
    # Instead of a bare barrier: nobody moves on (or loads) before the file is in place, and
    # everybody learns whether it is.
    outcome: _Failure = _broadcast(world_size, _describe(failure))
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


def load_checkpoint(
    directory: str | os.PathLike[str],
    state: MutableMapping[str, Any],
    *,
    map_location: str | torch.device | None = None,
) -> int | None:
    """Restore ``state`` in place from the newest complete checkpoint; return its step.

    The newest is the one written last, which need not have the highest step (a run restarted
    in a used folder). Call it on every rank. A file that fails to load (truncated, corrupt) is
    skipped with a warning and the previous one is tried. Returns None, leaving ``state``
    untouched, when ``directory`` holds no loadable checkpoint. When one rank cannot list the
    directory or restore its objects (``load_state_dict`` raising), every rank raises
    :class:`CheckpointError`, so that none trains on from a partial restore.
    """
    world_size, rank = _world()
    if map_location is None:
        context = current_or_none()
        map_location = context.device if context is not None else torch.device("cpu")
    payload: dict[str, Any] | None = None
    failure: Exception | None = None
    try:
        payload = _load_newest(Path(directory), map_location)
    except Exception as error:  # e.g. a directory this rank cannot list
        failure = error
    found = _all_gather(world_size, (_identity(payload), _describe(failure)))
    _raise_failures(
        [text for _, text in found],
        f"could not look for checkpoints in {directory}",
        hint="every rank must be able to read the checkpoint directory",
        own=failure,
    )
    newest = [identity for identity, _ in found]
    if len(set(newest)) > 1:
        raise ConfigError(
            f"ranks found different newest checkpoints in {directory}: (step, sequence) by "
            f"rank {newest}",
            hint="every rank must see the same checkpoint directory (a shared filesystem)",
        )
    if payload is None:
        return None
    step: int = payload["step"]
    try:
        for key, value in payload["state"].items():
            target = state.get(key)
            if isinstance(target, torch.nn.Module):
                load_state_dict(target, value)
            elif target is not None and hasattr(target, "load_state_dict"):
                target.load_state_dict(value)
            else:
                state[key] = value
    except Exception as error:  # shared below: no rank may train on from a partial restore
        failure = error
    _raise_failures(
        _all_gather(world_size, _describe(failure)),
        f"could not restore checkpoint step {step} from {directory}",
        hint="every rank must pass objects that match the checkpoint (the model, optimizer "
        "and loader of the run that saved it)",
        own=failure,
    )
    _restore_rng(payload, world_size, rank)
    return step


def checkpoint_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest written first (temporary files
    excluded; one whose write order cannot be read counts as the oldest)."""
    return [found.path for found in _written(Path(directory))]


class _Found(NamedTuple):
    """A complete checkpoint file, ordered by when it was written (then by step)."""

    sequence: int  # the save's place in the directory's write order; -1: unknown (unreadable)
    step: int
    path: Path
    problem: str | None  # why its sequence could not be read, or None


def _written(folder: Path) -> list[_Found]:
    """The complete checkpoints in ``folder``, oldest written first."""
    return sorted(_found(path, number) for number, path in _numbered(folder))


def _found(path: Path, step: int) -> _Found:
    """``path``'s sequence, read without its tensor data (mmap: only the pickle is read)."""
    try:
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception:  # a filesystem that cannot mmap reads it whole; a damaged file fails
            payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # truncated, empty, garbage, unreadable
        return _Found(-1, step, path, f"it cannot be loaded ({type(error).__name__}: {error})")
    if not isinstance(payload, dict) or payload.get("format") not in _READABLE:
        return _Found(-1, step, path, "not written by ddpkit.save_checkpoint")
    return _Found(int(payload.get("sequence", 0)), step, path, None)


def _identity(payload: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """(step, sequence) of a loaded checkpoint: what every rank must have found alike."""
    return None if payload is None else (payload["step"], payload.get("sequence", 0))


def _numbered(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [
        (int(match.group(1)), entry)
        for entry in folder.iterdir()
        if (match := _COMPLETE.fullmatch(entry.name)) is not None and entry.is_file()
    ]
    return sorted(found)


def _world() -> tuple[int, int]:
    """(world size, rank) of the process group that exists, ddpkit's or plain torch's."""
    context = current_or_none()
    if context is None:
        return 1, 0
    return context.world_size, context.rank


def _describe(error: BaseException | None) -> _Failure:
    """A failure as it travels to the other ranks: ddpkit's own errors by their message and
    hint, any other by its type and text."""
    if error is None:
        return None
    if isinstance(error, DdpkitError):
        return error.message, error.hint
    return f"{type(error).__name__}: {error}", None


def _all_gather(world_size: int, mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (a collective when the world is larger than one)."""
    if world_size == 1:
        return [mine]
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    return every


def _broadcast(world_size: int, value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _raise_failures(
    failures: list[_Failure], what: str, *, hint: str, own: Exception | None
) -> None:
    """Raise on every rank when any rank failed (its own error chained); ranks that failed
    alike are named together, and the first failure's own hint, if any, replaces ``hint``."""
    failed = [(number, failure) for number, failure in enumerate(failures) if failure]
    if not failed:
        return
    by_text: dict[str, list[int]] = {}
    for number, (text, _) in failed:
        by_text.setdefault(text, []).append(number)
    causes = "; ".join(f"{_ranks(numbers)}: {text}" for text, numbers in by_text.items())
    own_hint = next((given for _, (_, given) in failed if given), None)
    ranks = _ranks([number for number, _ in failed])
    raise CheckpointError(f"{ranks} {what}: {causes}", hint=own_hint or hint) from own


def _ranks(numbers: list[int]) -> str:
    label = "rank" if len(numbers) == 1 else "ranks"
    return f"{label} {', '.join(str(number) for number in numbers)}"


def _check_count(name: str, value: object, *, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}", hint=hint)


def _saveable(value: Any) -> Any:
    if isinstance(value, torch.nn.Module):
        value = unwrap(value)
    return value.state_dict() if hasattr(value, "state_dict") else value


def _save(folder: Path, payload: dict[str, Any], step: int, keep_last: int) -> Path:
    """Write ``payload`` as checkpoint ``step``, the newest in ``folder``; prune the others."""
    folder.mkdir(parents=True, exist_ok=True)
    # A dead writer's temporary file must not take the space this write needs; a failure
    # here is tried again (and warned of) by the prune after the write.
    with contextlib.suppress(OSError):
        _remove_stale_temps(folder)
    found = _written(folder)
    sequence = 1 + max((entry.sequence for entry in found), default=0)
    doomed = _doomed(found, step, keep_last)
    drop_cache([entry.path for entry in doomed])
    path = write_atomically(
        folder, f"ckpt-{step:09d}.pt", {"format": _FORMAT, "sequence": sequence, **payload}
    )
    # The file of the same step was replaced by the rename: it is this checkpoint now.
    _prune_or_warn(folder, [entry.path for entry in doomed if entry.step != step], step)
    _warn_higher_steps(folder, found, step)
    return path


def _doomed(found: list[_Found], step: int, keep_last: int) -> list[_Found]:
    """The checkpoints that a save of ``step`` replaces (the file of that step) or prunes (all
    but the ``keep_last - 1`` others written last); ``found`` is oldest written first."""
    others = [entry for entry in found if entry.step != step]
    pruned = others[: max(0, len(others) - (keep_last - 1))]
    return [entry for entry in found if entry.step == step] + pruned


def _warn_higher_steps(folder: Path, found: list[_Found], step: int) -> None:
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
        _prune(folder, doomed)
    except Exception as error:
        warnings.warn(
            f"checkpoint step {step} is saved in {folder}, but older files could not be "
            f"deleted ({type(error).__name__}: {error}); they will be tried again next save",
            RuntimeWarning,
            stacklevel=4,
        )


def _prune(folder: Path, doomed: list[Path]) -> None:
    """Delete ``doomed`` and the temporary files of dead writers (never a live writer's:
    another job, or another host, may be saving into the same folder)."""
    for old in doomed:
        old.unlink(missing_ok=True)
    _remove_stale_temps(folder)


def _remove_stale_temps(folder: Path) -> None:
    """Delete the temporary files that dead writers left in ``folder``."""
    for temp in stale_temps(folder, _TEMP_PREFIX):
        temp.unlink(missing_ok=True)


def _load_newest(folder: Path, map_location: str | torch.device) -> dict[str, Any] | None:
    """The newest written checkpoint that loads; every file skipped on the way is warned of."""
    found = _written(folder)
    for entry in found:
        if entry.problem is not None:
            _warn_skipped(entry.path, entry.problem)
    for entry in reversed([entry for entry in found if entry.problem is None]):
        try:
            payload: dict[str, Any] = torch.load(
                entry.path, map_location=map_location, weights_only=False
            )
        except Exception as error:  # damaged past the pickle: fall back to the previous one
            _warn_skipped(entry.path, f"it cannot be loaded ({type(error).__name__}: {error})")
            continue
        return payload
    return None


def _warn_skipped(path: Path, why: str) -> None:
    warnings.warn(
        f"skipping checkpoint {path}: {why}; the newest loadable one is used instead",
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
