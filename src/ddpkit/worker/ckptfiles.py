"""The files of a checkpoint folder and their write order, read without unpickling any of them.

A folder may hold files ddpkit did not write (a shared scratch folder): listing it, ordering its
checkpoints and pruning them must never run code from one. So a file's place in the write
order, its ``sequence``, is read from the first opcodes of its pickle (the payload dict starts
``{"format": 2, "sequence": N, "step": S, ...``), taken from the zip record ``data.pkl``
with :mod:`zipfile` and decoded with :func:`pickletools.genops`, which only reads opcodes:
no global is looked up, nothing is called. A file whose head is not that (damaged, empty,
another program's, a plain pickle) gets no sequence and counts as the oldest. A file can lie
about its sequence; that only changes which file a load tries first, and the load itself is
``weights_only`` (:mod:`ddpkit.worker.safeload`). Format 1 files (before the sequence) count
as older than any later save, by step among themselves.

Pruning deletes the files a save replaces or no longer keeps, and the temporary files of dead
writers (:func:`ddpkit.worker.durable.stale_temps`), never a live writer's.
"""

from __future__ import annotations

import io
import pickletools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from ddpkit import compat
from ddpkit.worker.durable import stale_temps

__all__ = ["COMPLETE", "READABLE", "Found", "doomed", "numbered", "prune", "written"]

READABLE = (1, 2)  # format 1 has no sequence: older than every format-2 save
# used with fullmatch: "$" also matches before a final newline ("ckpt-000000001.pt\n")
COMPLETE = re.compile(r"ckpt-(\d{9,})\.pt")
_TEMP_PREFIX = "ckpt-"  # temporary files are ".ckpt-<step>.pt.<writer>.tmp"
_HEAD_BYTES = 4096  # the header's few items take ~60 bytes; a bound, whatever the file holds
_MEMO = {"PROTO", "FRAME", "BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"}
_STRINGS = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE"}
_INTS = {"BININT", "BININT1", "BININT2", "LONG1", "INT", "LONG"}


class Found(NamedTuple):
    """A complete checkpoint file, ordered by when it was written (then by step)."""

    sequence: int  # the save's place in the directory's write order; -1: unknown (unreadable)
    step: int
    path: Path
    problem: str | None  # why its sequence could not be read, or None


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
        head = compat.saved_pickle_head(path, _HEAD_BYTES)
    except Exception as error:  # anyone's file: whatever its bytes make zipfile raise
        problem = f"it cannot be read as a checkpoint ({type(error).__name__}: {error})"
        return Found(-1, step, path, problem)
    header = header_of(head)
    version = header.get("format")
    if version not in READABLE or (version == 2 and "sequence" not in header):
        return Found(-1, step, path, "not written by ddpkit.save_checkpoint")
    return Found(header.get("sequence", 0), step, path, None)


def header_of(head: bytes) -> dict[str, int]:
    """The leading ``str: int`` items of the dict pickled in ``head`` (a bounded prefix),
    decoded opcode by opcode: ``{"format": 2, "sequence": 7, "step": 100}`` for a ddpkit
    checkpoint, ``{}`` for anything that does not start with such a dict."""
    operations = _operations(head)
    if [next(operations, None), next(operations, None)] != [("EMPTY_DICT", None), ("MARK", None)]:
        return {}
    items: dict[str, int] = {}
    for (key_op, key), (value_op, value) in zip(operations, operations, strict=False):
        if key_op not in _STRINGS or value_op not in _INTS or isinstance(value, bool):
            break
        if not isinstance(key, str) or not isinstance(value, int) or not 0 <= value < 2**63:
            break
        items[key] = value
    return items


def _operations(head: bytes) -> Iterator[tuple[str, object]]:
    """(opcode name, argument) of ``head``'s opcodes, memo bookkeeping left out; ends at the
    first opcode that cannot be decoded (the prefix's cut, or not a pickle)."""
    try:
        for opcode, argument, _ in pickletools.genops(io.BytesIO(head)):
            if opcode.name not in _MEMO:
                yield opcode.name, argument
    except Exception:  # truncated, unknown opcode: nothing after it is read
        return


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
