"""The files of a checkpoint folder and their write order, read without unpickling any of them.

A folder may hold files ddpkit did not write (a shared scratch folder): listing it, ordering its
checkpoints and pruning them must never run code from one. So a file's place in the write
order, its ``sequence``, is read from the first opcodes of its pickle (the payload dict starts
``{"format": 2, "sequence": N, "step": S, ...``), taken from the zip record ``data.pkl``
with :mod:`zipfile` and decoded with :func:`pickletools.genops`, which only reads opcodes:
no global is looked up, nothing is called. A file whose head is not that (damaged, empty,
another program's, a plain pickle) gets no sequence and counts as the oldest. A file can lie
about its sequence; that only changes which file a load tries first, and the load itself is
``weights_only`` (:mod:`ddpkit.worker.safeload`). A file is opened only when it is a regular
file, without waiting (:func:`ddpkit.worker.durable.open_regular`): a FIFO renamed over a
checkpoint's name after the listing would block a plain open for ever. Format 1 files (before
the sequence) count as older than any later save, by step among themselves.

The same head names the run that wrote the file (``"run_id": "slurm-1234", "attempt": 1``, after
``step`` and ``world_size``; a reader that takes integers only stops before them):
:func:`checkpoint_origin` reads it the same way, for any rank, without loading the file.

Pruning deletes the files a save replaces or no longer keeps, and the temporary files of dead
writers (:func:`ddpkit.worker.durable.stale_temps`), never a live writer's.
"""

from __future__ import annotations

import io
import os
import pickletools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from ddpkit import compat
from ddpkit.errors import CheckpointError
from ddpkit.worker.durable import open_regular, stale_temps

__all__ = [
    "COMPLETE",
    "READABLE",
    "Found",
    "Origin",
    "checkpoint_origin",
    "doomed",
    "next_sequence",
    "numbered",
    "prune",
    "written",
]

READABLE = (1, 2)  # format 1 has no sequence: older than every format-2 save
# used with fullmatch: "$" also matches before a final newline ("ckpt-000000001.pt\n")
COMPLETE = re.compile(r"ckpt-(\d{9,})\.pt")
_TEMP_PREFIX = "ckpt-"  # temporary files are ".ckpt-<step>.pt.<token>.hb.tmp"
_HEAD_BYTES = 4096  # the header's few items take ~200 bytes; a bound, whatever the file holds
_MAX_INT = 2**63 - 1  # the largest header int this reader takes (a sequence, a step)
_MAX_TEXT = 256  # a header string (the run id: 128 at most); a longer one ends the header
_MEMO = {"PROTO", "FRAME", "BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"}
_STRINGS = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE"}
_INTS = {"BININT", "BININT1", "BININT2", "LONG1", "INT", "LONG"}


class Found(NamedTuple):
    """A complete checkpoint file, ordered by when it was written (then by step)."""

    sequence: int  # the save's place in the directory's write order; -1: unknown (unreadable)
    step: int
    path: Path
    problem: str | None  # why its sequence could not be read, or None


class Origin(NamedTuple):
    """Which run wrote a checkpoint: its ``run_id`` and ``attempt`` (None in a checkpoint saved
    without them: by an older ddpkit, or with no run id known), and the file and its step."""

    path: Path
    step: int
    run_id: str | None
    attempt: int | None


def written(folder: Path) -> list[Found]:
    """The complete checkpoints in ``folder``, oldest written first."""
    return sorted(found(path, number) for number, path in numbered(folder))


def numbered(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    entries = [
        (int(match.group(1)), entry)
        for entry in folder.iterdir()
        if (match := COMPLETE.fullmatch(entry.name)) is not None and entry.is_file()
    ]
    return sorted(entries)


def found(path: Path, step: int) -> Found:
    """``path``'s place in the write order, read from its header (nothing unpickled)."""
    try:
        with open_regular(path) as file:
            head = compat.saved_pickle_head(file, _HEAD_BYTES)
    except Exception as error:  # anyone's file: whatever its bytes make zipfile raise
        problem = f"it cannot be read as a checkpoint ({type(error).__name__}: {error})"
        return Found(-1, step, path, problem)
    header = header_of(head)
    version, sequence = header.get("format"), header.get("sequence", 0)
    if version not in READABLE or (version == 2 and "sequence" not in header):
        return Found(-1, step, path, "not written by ddpkit.save_checkpoint")
    if not isinstance(sequence, int):
        return Found(-1, step, path, "not written by ddpkit.save_checkpoint")
    return Found(sequence, step, path, None)


def header_of(head: bytes) -> dict[str, int | str]:
    """The leading ``str: int`` and short ``str: str`` items of the dict pickled in ``head`` (a
    bounded prefix), decoded opcode by opcode: ``{"format": 2, "sequence": 7, "step": 100,
    ...}`` for a ddpkit checkpoint, ``{}`` for anything that does not start with such a dict."""
    operations = _operations(head)
    if [next(operations, None), next(operations, None)] != [("EMPTY_DICT", None), ("MARK", None)]:
        return {}
    items: dict[str, int | str] = {}
    for (key_op, key), (value_op, value) in zip(operations, operations, strict=False):
        if key_op not in _STRINGS or not isinstance(key, str) or not _plain(value_op, value):
            break
        assert isinstance(value, int | str)  # for mypy: _plain checked it
        items[key] = value
    return items


def _plain(opcode: str, value: object) -> bool:
    """Whether a header value is one this reader takes: an int in 0..2**63-1, a short str."""
    if opcode in _INTS:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_INT
    return opcode in _STRINGS and isinstance(value, str) and len(value) <= _MAX_TEXT


def checkpoint_origin(path: str | os.PathLike[str]) -> Origin | None:
    """Which run wrote checkpoint ``path``, or the newest complete one when ``path`` is a
    folder (the file ``load_checkpoint`` tries first); None when there is none. Reads the head
    of the file only (nothing unpickled, no collective: any rank may ask)."""
    target = Path(path)
    if target.is_dir():
        entries = [entry for entry in written(target) if entry.problem is None]
        if not entries:
            return None
        target = entries[-1].path
    try:
        with open_regular(target) as file:
            header = header_of(compat.saved_pickle_head(file, _HEAD_BYTES))
    except Exception:  # a missing or foreign file: no ddpkit checkpoint, no origin
        return None
    step, run_id, attempt = (header.get(key) for key in ("step", "run_id", "attempt"))
    if header.get("format") not in READABLE or not isinstance(step, int):
        return None
    return Origin(
        target,
        step,
        run_id if isinstance(run_id, str) else None,
        attempt if isinstance(attempt, int) else None,
    )


def _operations(head: bytes) -> Iterator[tuple[str, object]]:
    """(opcode name, argument) of ``head``'s opcodes, memo bookkeeping left out; ends at the
    first opcode that cannot be decoded (the prefix's cut, or not a pickle)."""
    try:
        for opcode, argument, _ in pickletools.genops(io.BytesIO(head)):
            if opcode.name not in _MEMO:
                yield opcode.name, argument
    except Exception:  # truncated, unknown opcode: nothing after it is read
        return


def next_sequence(folder: Path, entries: list[Found]) -> int:
    """The sequence of the next save in ``folder``: one more than any of ``entries``. A file
    claiming the last sequence the reader takes (only a forged one can: no run saves 2**63
    times) is an error naming it: the next save's sequence would not be readable, so the run's
    own checkpoints would count as foreign files from then on (pruned first, skipped by a
    load)."""
    last = max(entries, key=lambda entry: entry.sequence, default=None)
    if last is None or last.sequence < _MAX_INT:
        return 1 + max(0, last.sequence if last is not None else 0)
    raise CheckpointError(
        f"{last.path} claims to be save number {last.sequence} in {folder}, the last one a "
        "checkpoint can record: no run saves that often (a forged or planted file), and a save "
        "after it could not be ordered after it",
        hint=f"remove {last.path}, or save to a folder only your own runs write to",
    )


def doomed(entries: list[Found], step: int, keep_last: int) -> list[Found]:
    """The checkpoints that a save of ``step`` replaces (the file of that step) or prunes (all
    but the ``keep_last - 1`` others written last); ``entries`` is oldest written first."""
    others = [entry for entry in entries if entry.step != step]
    pruned = others[: max(0, len(others) - (keep_last - 1))]
    return [entry for entry in entries if entry.step == step] + pruned


def remove_stale_temps(folder: Path) -> None:
    """Delete the temporary files that dead writers left in ``folder``."""
    for temp in stale_temps(folder, _TEMP_PREFIX):
        temp.unlink(missing_ok=True)


def prune(folder: Path, old: list[Path]) -> None:
    """Delete ``old`` and the temporary files of dead writers (never a live writer's: another
    job, or another host, may be saving into the same folder)."""
    for path in old:
        path.unlink(missing_ok=True)
    remove_stale_temps(folder)
