"""Writing a file so that a crash leaves either the old state or the complete new one, fast.

A new hidden temporary file in the same folder (mode 0666 less the umask, as ``torch.save``
would create it), streamed with writeback started every 16 MB (``sync_file_range``: the final
fsync then has little left to flush), fsynced, renamed over the final name, and the folder
fsynced so that the rename itself is durable. ``drop_cache`` releases the page cache of files
about to be deleted, so that their eviction does not slow the write. Used by checkpoints.

What a crash leaves behind: a ``kill -9`` mid-write leaves its temporary file, named
``.<final>.<token>.hb.tmp`` (``hb``: its writer touches it every :data:`HEARTBEAT_S` while the
write runs, pickling and fsync included). :func:`stale_temps` finds those whose writer is dead
by one rule, the same for every writer, on this host or another one sharing the folder: a
file not touched for :data:`BEAT_STALE_AFTER_S` (a dozen missed heartbeats). The age is
measured on the filesystem's clock too (a file server's may lag this node's: the time of a
file created in the folder for the purpose), so a skewed node clock takes no live writer's
file. A name without ``hb`` (a ddpkit from before the heartbeat, a hand-made name) gets
:data:`STALE_AFTER_S`, as such a writer touches its file only when it writes data. A process
ID would tell a dead writer sooner, but only on its own host and PID namespace: the age tells
it everywhere, within minutes. Only a writer stalled that long mid-save (a suspended job) can
lose its file, and then its own save fails with a clear error.

A write that runs out of space (ENOSPC, EDQUOT, a write that writes nothing), whether the
failure reaches the caller as an ``OSError`` or as the ``RuntimeError`` torch's zip writer
makes of it ("unexpected pos"), raises :class:`CheckpointError` saying so: how many MB the file
needs and how many are free in the folder (``shutil.disk_usage``).
"""

from __future__ import annotations

import contextlib
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
    "drop_cache",
    "fsync_directory",
    "newest_mtime",
    "older_than",
    "open_regular",
    "stale_temps",
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
    """A new hidden temporary file for ``name``, open for writing, with mode 0666 less the umask
    (and the directory's default ACL) as ``torch.save`` would create it; mkstemp's 0600 would
    keep the checkpoint from teammates and evaluation jobs."""
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
    """Touch the open file every :data:`HEARTBEAT_S` while the block runs (a thread: pickling
    a large state or an fsync can take minutes without a write), so that a save elsewhere sees
    its writer alive; stopped before the descriptor is closed."""
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
    """The one-line error for a write that ran out of space: how much it needs, how much the
    folder's filesystem has free (a quota, EDQUOT, may be less than the free space)."""
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
    """The bytes of the tensors in ``payload`` (each storage once): what ``torch.save`` writes,
    but for the pickle (small) and values that are not containers (not looked into)."""
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


def stale_temps(folder: Path, prefix: str, *, directories: bool = False) -> list[Path]:
    """The temporary files ``.<prefix>*.tmp`` in ``folder`` whose writer is dead (see the
    module's docstring); regular files only, a link is never followed. ``directories``: the
    temporary folders instead (a sharded checkpoint's, :mod:`ddpkit.worker.sharded`), dated
    by the newest of the folder and its files (the files grow while the ranks write)."""
    found = []
    clock = _Clock(folder)
    for entry in folder.iterdir():
        name = entry.name
        if not (name.startswith(f".{prefix}") and name.endswith(".tmp")):
            continue
        try:
            info = entry.lstat()
            kind = stat.S_ISDIR(info.st_mode) if directories else stat.S_ISREG(info.st_mode)
            modified = newest_mtime(entry) if kind and directories else info.st_mtime
        except FileNotFoundError:  # renamed or removed meanwhile
            continue
        if kind and _stale(name, modified, clock):
            found.append(entry)
    return found


def newest_mtime(directory: Path) -> float:
    """The newest modification time of ``directory`` and the entries in it (not recursive)."""
    times = [directory.lstat().st_mtime]
    for entry in directory.iterdir():
        with contextlib.suppress(FileNotFoundError):
            times.append(entry.lstat().st_mtime)
    return max(times)


def older_than(folder: Path, modified: float, bound_s: float) -> bool:
    """Whether a time read in ``folder`` is older than ``bound_s`` by both clocks (this node's
    and the folder's filesystem's, see :class:`_Clock`)."""
    return _Clock(folder).older(modified, bound_s)


def _stale(name: str, modified: float, clock: _Clock) -> bool:
    return clock.older(modified, BEAT_STALE_AFTER_S if name.endswith(".hb.tmp") else STALE_AFTER_S)


class _Clock:
    """Whether a file's time is older than a bound, by this node's clock and by the clock of
    the filesystem that dated it (a file server's, which may lag this node's by minutes):
    the time of a file created now in the folder, read once, when first needed. Where none
    can be created (permissions, no inode left), only the quarter-hour bound is trusted."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._local = time.time()
        self._read = False
        self._filesystem: float | None = None

    def older(self, modified: float, bound: float) -> bool:
        if self._local - modified <= bound:
            return False
        if not self._read:
            self._filesystem, self._read = _filesystem_now(self._folder), True
        if self._filesystem is None:
            return self._local - modified > max(bound, STALE_AFTER_S)
        return self._filesystem - modified > bound


def _filesystem_now(folder: Path) -> float | None:
    """The folder's filesystem's time now: that of a file created there (removed at once;
    named as a temporary file, so that a kill -9 right here leaves nothing for good)."""
    try:
        descriptor, probe = _create_temp(folder, "ckpt-clock")
    except OSError:
        return None
    try:
        return os.fstat(descriptor).st_mtime
    finally:
        os.close(descriptor)
        probe.unlink(missing_ok=True)


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
        self.written = 0
        self.failure: OSError | None = None  # the write's own error, which torch hides
        self._requested = 0  # bytes already handed to a writeback request
        self._start_writeback = _sync_file_range()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            room = len(view)
            if self._start_writeback is not None:
                room = min(room, _WRITEBACK_CHUNK - (self.written - self._requested))
            written = self._write(view[:room])
            view = view[written:]
            self.written += written
            if self._start_writeback is not None and (
                self.written - self._requested >= _WRITEBACK_CHUNK
            ):
                self._start_writeback(self._descriptor, self._requested, self.written)
                self._requested = self.written
        return size

    def _write(self, data: memoryview) -> int:
        try:
            written = os.write(self._descriptor, data)
            if written == 0:  # a regular file takes at least a byte unless it has no room
                raise OSError(errno.ENOSPC, "a write wrote nothing")
        except OSError as error:
            self.failure = error
            raise
        return written

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
    """``path`` open for reading, when it is a regular file (a link to one included); OSError
    otherwise. Never waits: a FIFO renamed over a checkpoint's name after a listing saw a file
    there would make a plain open wait for a writer for ever."""
    descriptor = _open_regular(path)
    return os.fdopen(descriptor, "rb")


def _open_regular(path: Path) -> int:
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def drop_cache(paths: list[Path]) -> None:
    """Release the cached pages of files about to be deleted; they stay complete on disk.

    Best effort, and never a reason to fail a save: a file that cannot be opened is skipped.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            descriptor = _open_regular(path)
        except OSError:
            continue
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(descriptor)


def fsync_directory(folder: Path) -> None:
    """Make the entries of ``folder`` (a rename into it) durable."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
