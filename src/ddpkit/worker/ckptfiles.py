"""The files of a checkpoint folder, their write order and origin, read from their names.

A folder may hold files ddpkit did not write: listing, ordering and pruning never open one. A
save names its file ``ckpt-<step:09d>-<sequence:09d>[-<run id>-a<attempt>].pt``: ``sequence``
is its place in the folder's write order, the run id and attempt (:mod:`ddpkit.cluster.runid`)
the run that wrote it. A name can lie (anyone can rename a file): that only changes which file a
load tries first, or the origin reported. Older names, ``ckpt-<step:09d>.pt``, count as older
than any newer save, by step among themselves, and have no origin.

Pruning deletes the files a save replaces or no longer keeps and, with them, the sharded
``ckpt-<...>.dcp`` folder next to a file (:func:`shards_of`), and what dead writers left
(:func:`remove_stale_temps`, by the rule of :mod:`ddpkit.worker.durable`, never a live
writer's): temporary files and folders, and a ``.dcp`` folder whose file never came, once
untouched for :data:`~ddpkit.worker.durable.STALE_AFTER_S`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from pathlib import Path
from typing import NamedTuple

from ddpkit.contract import RUN_ID_MAX_CHARS
from ddpkit.errors import CheckpointError
from ddpkit.worker.durable import BEAT_STALE_AFTER_S, STALE_AFTER_S, Clock

__all__ = [
    "COMPLETE",
    "Found",
    "Origin",
    "checkpoint_origin",
    "doomed",
    "file_name",
    "next_sequence",
    "prune",
    "remove_stale_temps",
    "shards_of",
    "written",
]

_LAST = 10**18 - 1  # the largest sequence a name holds (18 digits)
# used with fullmatch: "$" also matches before a final newline ("ckpt-000000001.pt\n")
COMPLETE = re.compile(
    r"ckpt-(?P<step>\d{9,})"
    r"(?:-(?P<sequence>\d{9,18})"
    rf"(?:-(?P<run>[A-Za-z0-9][A-Za-z0-9._-]{{0,{RUN_ID_MAX_CHARS - 1}}})"
    r"-a(?P<attempt>\d{1,18}))?)?"
    r"\.pt"
)


class Found(NamedTuple):
    """A complete checkpoint file, ordered by when it was written (then by step)."""

    sequence: int  # the save's place in the folder's write order; 0: an older ddpkit's name
    step: int
    path: Path
    run_id: str | None
    attempt: int | None


class Origin(NamedTuple):
    """Which run wrote a checkpoint: its ``run_id`` and ``attempt`` (None in a checkpoint saved
    without them: by an older ddpkit, or with no run named), and the file and its step."""

    path: Path
    step: int
    run_id: str | None
    attempt: int | None


def file_name(step: int, sequence: int, run: tuple[str, int] | None) -> str:
    """The name of save number ``sequence`` of ``step`` by ``run`` (run id, attempt) or none."""
    origin = f"-{run[0]}-a{run[1]}" if run is not None else ""
    return f"ckpt-{step:09d}-{sequence:09d}{origin}.pt"


def parsed(path: Path) -> Found | None:
    """``path`` as a checkpoint, from its name alone; None for any other name."""
    match = COMPLETE.fullmatch(path.name)
    if match is None:
        return None
    attempt = match["attempt"]
    return Found(
        int(match["sequence"] or 0),
        int(match["step"]),
        path,
        match["run"],
        None if attempt is None else int(attempt),
    )


def written(folder: Path) -> list[Found]:
    """The complete checkpoints in ``folder``, oldest written first."""
    if not folder.is_dir():
        return []
    entries = [parsed(entry) for entry in folder.iterdir()]
    return sorted(entry for entry in entries if entry is not None and entry.path.is_file())


def checkpoint_origin(path: str | os.PathLike[str]) -> Origin | None:
    """Which run wrote checkpoint ``path``, or the newest complete one when ``path`` is a
    folder (the file ``load_checkpoint`` tries first); None when there is none, or ``path`` is
    not named as a checkpoint. Reads the names only (no file opened, no collective: any rank
    may ask)."""
    target = Path(path)
    entries = written(target) if target.is_dir() else [parsed(target)]
    entry = entries[-1] if entries else None
    if entry is None or not entry.path.is_file():
        return None
    return Origin(entry.path, entry.step, entry.run_id, entry.attempt)


def next_sequence(folder: Path, entries: list[Found]) -> int:
    """The sequence of the next save in ``folder``: one more than any of ``entries``. A file
    named with the last sequence a name holds (only a forged one can be: no run saves 10**18
    times) is an error naming it: the next save's name would not be read as a checkpoint, so
    the run's own saves would be invisible from then on."""
    last = max(entries, key=lambda entry: entry.sequence, default=None)
    if last is None or last.sequence < _LAST:
        return 1 + (last.sequence if last is not None else 0)
    raise CheckpointError(
        f"{last.path} claims to be save number {last.sequence} in {folder}, the last one a "
        "checkpoint name can hold: no run saves that often (a forged or planted file), and a "
        "save after it could not be ordered after it",
        hint=f"remove {last.path}, or save to a folder only your own runs write to",
    )


def doomed(entries: list[Found], step: int, keep_last: int) -> list[Found]:
    """The checkpoints that a save of ``step`` replaces (the files of that step) or prunes (all
    but the ``keep_last - 1`` others written last); ``entries`` is oldest written first."""
    others = [entry for entry in entries if entry.step != step]
    pruned = others[: max(0, len(others) - (keep_last - 1))]
    return [entry for entry in entries if entry.step == step] + pruned


def shards_of(path: Path) -> Path:
    """The folder of checkpoint file ``path``'s sharded state (which may not exist)."""
    return path.with_suffix(".dcp")


def remove_stale_temps(folder: Path) -> None:
    """Delete what dead writers left in ``folder``: temporary files (``.ckpt-<...>.tmp``,
    regular files only, never a link), temporary sharded folders and the sharded folders whose
    checkpoint file never came, these dated by their newest entry (the ranks' files grow while
    they write)."""
    clock = Clock(folder)
    for entry in folder.iterdir():
        name = entry.name
        temp = name.startswith(".ckpt-") and name.endswith(".tmp")
        sharded = entry.suffix == ".dcp" and COMPLETE.fullmatch(entry.with_suffix(".pt").name)
        if not (temp or sharded):
            continue
        try:
            info = entry.lstat()
            if temp and stat.S_ISREG(info.st_mode):
                bound = BEAT_STALE_AFTER_S if name.endswith(".hb.tmp") else STALE_AFTER_S
                if clock.older(info.st_mtime, bound):
                    entry.unlink(missing_ok=True)
            elif (
                stat.S_ISDIR(info.st_mode)
                and (temp or not entry.with_suffix(".pt").exists())
                and clock.older(_newest_mtime(entry), STALE_AFTER_S)
            ):
                shutil.rmtree(entry, ignore_errors=True)
        except FileNotFoundError:  # renamed or removed meanwhile
            continue


def _newest_mtime(directory: Path) -> float:
    """The newest modification time of ``directory`` and the entries in it (not recursive)."""
    times = [directory.lstat().st_mtime]
    for entry in directory.iterdir():
        with contextlib.suppress(FileNotFoundError):
            times.append(entry.lstat().st_mtime)
    return max(times)


def prune(folder: Path, old: list[Path]) -> None:
    """Delete ``old`` and the temporary files of dead writers (never a live writer's: another
    job, or another host, may be saving into the same folder)."""
    for path in old:
        path.unlink(missing_ok=True)
        shutil.rmtree(shards_of(path), ignore_errors=True)  # if it has one
    remove_stale_temps(folder)
