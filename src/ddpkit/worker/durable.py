"""Writing a file so that a crash leaves either the old state or the complete new one, fast.

A new hidden temporary file in the same folder (mode 0666 less the umask, as ``torch.save``
would create it), streamed with writeback started every 16 MB (the final fsync then has little
left to flush), fsynced, renamed over the final name, and the folder fsynced.

A ``kill -9`` mid-write leaves its temporary file ``.<final>.<token>.hb.tmp``, which its writer
touches every :data:`HEARTBEAT_S`. A writer is dead when its file was not touched for
:data:`BEAT_STALE_AFTER_S`, by this node's clock and by the filesystem's (:class:`Clock`: a
file server's may lag), a rule that holds for writers on any host sharing the folder; a name
without ``hb`` (an older ddpkit's) gets :data:`STALE_AFTER_S`
(:func:`ddpkit.worker.ckptfiles.remove_stale_temps` applies it).

A write that runs out of space (ENOSPC, EDQUOT, also as torch's "unexpected pos") raises
:class:`CheckpointError` saying how many MB the file needs and how many are free.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import secrets
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import torch

from ddpkit.errors import CheckpointError

__all__ = [
    "BEAT_STALE_AFTER_S",
    "HEARTBEAT_S",
    "STALE_AFTER_S",
    "Clock",
    "drop_cache",
    "fsync_directory",
    "open_regular",
    "write_atomically",
]

_WRITEBACK_CHUNK = 16 * 2**20  # bytes written between two writeback requests
# A writer touches its temporary file this often while its write runs.
HEARTBEAT_S = 10.0
# A touched ("hb") temporary file not touched for this long is stale.
BEAT_STALE_AFTER_S = 120.0
# Any other temporary file (an older ddpkit's, a hand-made name) not written for this long.
STALE_AFTER_S = 15 * 60.0
_MB = 10**6
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


def _create_temp(folder: Path, name: str) -> tuple[int, Path]:
    """A new hidden temporary file for ``name``, open for writing, mode 0666 less the umask
    (mkstemp's 0600 would keep the checkpoint from teammates and evaluation jobs)."""
    while True:
        temp = folder / f".{name}.{secrets.token_hex(4)}.hb.tmp"
        try:
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temp
        except FileExistsError:  # drawn before: draw again
            continue


def write_atomically(folder: Path, name: str, payload: Any) -> Path:
    """Write ``payload`` (``torch.save``) as ``folder/name``: all of it or nothing."""
    final = folder / name
    try:
        descriptor, temp = _create_temp(folder, name)
    except OSError as error:
        if error.errno in _NO_SPACE:  # no inode left is no space too
            raise _no_space(error, folder, payload, 0) from error
        raise
    stream = _StreamingFile(descriptor)
    try:
        try:
            with _heartbeat(descriptor):
                # torch.save calls only write() and flush() on a file object.
                torch.save(payload, cast("IO[bytes]", stream))
                os.fsync(descriptor)  # durable before it gets its final name
        finally:
            os.close(descriptor)
        _replace(temp, final)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        # torch reports a failed write as its own RuntimeError; the stream kept the real one
        cause = stream.failure if stream.failure is not None else error
        if isinstance(cause, OSError) and cause.errno in _NO_SPACE:
            raise _no_space(cause, folder, payload, stream.written) from error
        raise
    fsync_directory(folder)  # make the rename itself durable
    return final


@contextmanager
def _heartbeat(descriptor: int) -> Iterator[None]:
    """Touch the open file every :data:`HEARTBEAT_S` while the block runs (pickling or an
    fsync can take minutes without a write), so that a save elsewhere sees its writer alive."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                os.utime(descriptor)
            except OSError:  # a best effort: the file's writes touch it too
                continue

    thread = threading.Thread(target=beat, name="ddpkit-checkpoint-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=HEARTBEAT_S)  # bounded: one utime left on a hung filesystem


def _replace(temp: Path, final: Path) -> None:
    try:
        os.replace(temp, final)
    except FileNotFoundError as error:
        if temp.parent.is_dir():
            raise CheckpointError(
                f"{temp.name} was deleted while {final.name} was being written to it",
                hint=f"another job sharing {temp.parent} took it for a dead writer's file "
                f"(not touched for {BEAT_STALE_AFTER_S / 60:.0f} minutes: a suspended save?); save "
                "again, or give each job its own directory",
            ) from error
        raise


def _no_space(error: OSError, folder: Path, payload: Any, written: int) -> CheckpointError:
    """The one-line error for a write that ran out of space: how much it needs and has free."""
    needed = -(-max(written, _payload_bytes(payload)) // _MB)  # rounded up
    try:
        free = f"{shutil.disk_usage(folder).free // _MB} MB free"
    except OSError:
        free = "free space unknown"
    what = "no space left on device" if error.errno == errno.ENOSPC else "disk quota exceeded"
    return CheckpointError(
        f"{what} ({needed} MB needed, {free} in {folder})",
        hint=f"free space in {folder} or save elsewhere; the new checkpoint is written before "
        "the oldest one is deleted, so the folder needs room for keep_last + 1 checkpoints",
    )


def _payload_bytes(payload: Any) -> int:
    """The bytes of the tensors in ``payload`` (each storage once), about what ``torch.save``
    writes."""
    seen: set[tuple[str, int]] = set()
    total, pending = 0, [payload]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            try:
                storage = value.untyped_storage()
                key = (str(storage.device), storage.data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse, meta, subclasses: skipped
                continue
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list | tuple | set | frozenset):
            pending.extend(value)
    return total


class Clock:
    """Whether a time read in ``folder`` is older than a bound by this node's clock and by the
    filesystem's (the time of a file created in the folder, read once when needed); where none
    can be created, only the quarter-hour bound is trusted."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._local = time.time()

    def older(self, modified: float, bound: float) -> bool:
        if self._local - modified <= bound:
            return False
        if self._filesystem is None:
            return self._local - modified > max(bound, STALE_AFTER_S)
        return self._filesystem - modified > bound

    @functools.cached_property
    def _filesystem(self) -> float | None:
        """The folder's filesystem's time now: that of a temporary file created there."""
        try:
            descriptor, probe = _create_temp(self._folder, "ckpt-clock")
        except OSError:
            return None
        try:
            return os.fstat(descriptor).st_mtime
        finally:
            os.close(descriptor)
            probe.unlink(missing_ok=True)


class _StreamingFile:
    """The file object ``torch.save`` writes to: every ``_WRITEBACK_CHUNK`` bytes it asks the
    kernel to start writing them back (``sync_file_range``, which does not wait), so the fsync
    after it has only the tail left. Without the call (not Linux) only the fsync remains."""

    def __init__(self, descriptor: int) -> None:
        self._descriptor = descriptor
        self.written = 0
        self.failure: OSError | None = None  # the write's own error, which torch hides
        self._requested = 0  # bytes already handed to a writeback request
        self._start_writeback = _sync_file_range()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            room = _WRITEBACK_CHUNK - (self.written - self._requested)
            try:
                written = os.write(self._descriptor, view[:room])
                if written == 0:  # a regular file takes at least a byte unless it has no room
                    raise OSError(errno.ENOSPC, "a write wrote nothing")
            except OSError as error:
                self.failure = error
                raise
            view = view[written:]
            self.written += written
            if self.written - self._requested >= _WRITEBACK_CHUNK:
                if self._start_writeback is not None:
                    self._start_writeback(self._descriptor, self._requested, self.written)
                self._requested = self.written
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


def open_regular(path: Path) -> IO[bytes]:
    """``path`` open for reading if it is a regular file (through a link too), else OSError;
    never waits (a plain open of a FIFO planted there would wait for ever)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(descriptor)
        raise
    return os.fdopen(descriptor, "rb")


def drop_cache(paths: list[Path]) -> None:
    """Release the cached pages of files about to be deleted, so the write can reuse them; a
    best effort that never fails a save."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            with open_regular(path) as file:
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            continue


def fsync_directory(folder: Path) -> None:
    """Make the entries of ``folder`` (a rename into it) durable."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
