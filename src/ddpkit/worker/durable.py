"""Writing a file so that a crash leaves either the old state or the complete new one, fast.

A new hidden temporary file in the same folder (mode 0666 less the umask, as ``torch.save``
would create it), streamed with writeback started every 16 MB (``sync_file_range``: the final
fsync then has little left to flush), fsynced, renamed over the final name, and the folder
fsynced so that the rename itself is durable. ``drop_cache`` releases the page cache of files
about to be deleted, so that their eviction does not slow the write. Used by checkpoints.
"""

from __future__ import annotations

import ctypes
import functools
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import torch

__all__ = ["drop_cache", "write_atomically"]

_WRITEBACK_CHUNK = 16 * 2**20  # bytes written between two writeback requests


def _create_temp(folder: Path, name: str) -> tuple[int, Path]:
    """A new hidden temporary file for ``name``, open for writing, with mode 0666 less the umask
    (and the directory's default ACL) as ``torch.save`` would create it; mkstemp's 0600 would
    keep the checkpoint from teammates and evaluation jobs."""
    while True:
        temp = folder / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temp
        except FileExistsError:  # another killed writer's name: draw again
            continue


def write_atomically(folder: Path, name: str, payload: Any) -> Path:
    descriptor, temp = _create_temp(folder, name)
    try:
        try:
            # torch.save calls only write() and flush() on a file object.
            torch.save(payload, cast("IO[bytes]", _StreamingFile(descriptor)))
            os.fsync(descriptor)  # durable before it gets its final name
        finally:
            os.close(descriptor)
        final = folder / name
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(folder)  # make the rename itself durable
    return final


class _StreamingFile:
    """The file object ``torch.save`` writes to: every ``_WRITEBACK_CHUNK`` bytes written (a
    large tensor is written in pieces of that size), it asks the kernel to start writing them
    to disk (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait), so the
    writeback overlaps the serialization and the fsync after it has only the tail left; a
    plain ``torch.save`` leaves it all for later. Where the call is missing (not Linux), the
    data is written in one go and only the fsync remains.
    """

    def __init__(self, descriptor: int) -> None:
        self._descriptor = descriptor
        self._written = 0
        self._requested = 0  # bytes already handed to a writeback request
        self._start_writeback = _sync_file_range()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            room = len(view)
            if self._start_writeback is not None:
                room = min(room, _WRITEBACK_CHUNK - (self._written - self._requested))
            written = os.write(self._descriptor, view[:room])
            view = view[written:]
            self._written += written
            if self._start_writeback is not None and (
                self._written - self._requested >= _WRITEBACK_CHUNK
            ):
                self._start_writeback(self._descriptor, self._requested, self._written)
                self._requested = self._written
        return size

    def flush(self) -> None:
        """Nothing is buffered here: every write went straight to the kernel."""


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


@functools.cache
def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """``start(descriptor, begin, end)``: a writeback hint for bytes begin..end, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # a libc without it
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int

    def start(descriptor: int, begin: int, end: int) -> None:
        function(descriptor, begin, end - begin, _SYNC_FILE_RANGE_WRITE)  # a hint: no check

    return start


def drop_cache(paths: list[Path]) -> None:
    """Release the cached pages of files about to be deleted; they stay complete on disk.

    Best effort, and never a reason to fail a save: a file that cannot be opened is skipped.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(descriptor)


def _fsync_directory(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
