"""What a kill -9 mid-save leaves behind, and a disk that is (nearly) full.

A real writer process saves a large state and is killed with SIGKILL at several moments of the
save (while pickling, after 1%, 50% and 99% of the data, after the fsync, after the rename); the
pause points are hooks in that writer process only (the file, the kill and the next save are
real). Its temporary file must be removed by the next save, before that save writes, while a
live writer's (another job saving into the same folder) is left alone. Disk-full cases run on a
real small tmpfs mounted for the test (root needed: under CI=true its absence fails the test).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpkit
from ddpkit.errors import CheckpointError
from ddpkit.worker import durable
from tests.support.needs import missing

MiB = 2**20
_WAIT_S = 90.0  # the writer imports torch on a loaded 2-core machine before it gets anywhere

_WRITER = textwrap.dedent(
    """
    import collections, os, sys, time
    from pathlib import Path
    import torch
    import ddpkit
    from ddpkit.worker import durable

    folder, marker, moment = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    size, step = int(sys.argv[4]), int(sys.argv[5])
    go = Path(f"{marker}.go")
    durable._WRITEBACK_CHUNK = 256 * 1024  # the data in many writes: a pause lands mid-file
    durable.HEARTBEAT_S = 0.2  # the live writer touches its file often: a test waits little

    def pause(where):
        marker.write_text(where)
        deadline = time.monotonic() + 120  # never outlive a test that died
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    real_write, real_fsync, real_replace = os.write, os.fsync, os.replace
    written = 0

    def write(descriptor, data):
        global written
        count = real_write(descriptor, data)
        written += count
        if moment.startswith("written-") and written >= size * float(moment[8:]):
            if not marker.exists():
                pause(moment)
        return count

    def fsync(descriptor):
        real_fsync(descriptor)
        if moment == "fsynced" and not marker.exists():
            pause(moment)

    def replace(source, target):
        real_replace(source, target)
        if moment == "renamed" and not marker.exists():
            pause(moment)

    class Pickling:
        # pickled inside torch.save, with the temporary file already created
        def __reduce__(self):
            if moment == "pickling":
                pause(moment)
            return (collections.OrderedDict, ())  # one of the globals loads allow

    os.write, os.fsync, os.replace = write, fsync, replace
    state = {"big": torch.ones(size // 4), "mark": Pickling()}
    ddpkit.save_checkpoint(folder, state, step=step)
    print("saved", flush=True)
    """
)

MOMENTS = ["pickling", "written-0.01", "written-0.5", "written-0.99", "fsynced", "renamed"]


def _write_in_fork(arguments: list[str], log: str) -> None:
    """The writer in a process forked from run_workers' server (torch imported once): the
    script as ``python -c`` would run it, its output to ``log``."""
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    sys.argv = ["-c", *arguments]
    exec(compile(_WRITER, "<writer>", "exec"), {"__name__": "__main__"})
    sys.stdout.flush()


_CLONE_NEWPID, _PR_SET_PDEATHSIG = 0x20000000, 1


def _write_elsewhere(arguments: list[str], log: str) -> None:
    """What ``unshare --pid --fork --kill-child`` does, forked from the fork server (torch
    imported once, not a new interpreter): this process enters a new PID namespace, its one
    child writes there (its PID 1; it dies with this process), and this process exits with
    the child's exit code."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWPID) failed")
    child = os.fork()
    if child == 0:  # the first process of the new PID namespace
        code = 1
        try:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            _write_in_fork(arguments, log)
            code = 0
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


class _Writer:
    """A process saving checkpoint ``step`` of ``size`` bytes into ``folder``, paused at
    ``moment`` until it is killed or let go. On this host: forked from run_workers' fork
    server; elsewhere: forked from it too, then the writer in a PID namespace of its own."""

    def __init__(
        self, folder: Path, moment: str, size: int, step: int, elsewhere: bool = False
    ) -> None:
        self.marker = folder.parent / f"paused-{moment}-{step}"
        self.log = folder.parent / f"writer-{moment}-{step}.log"
        arguments = [str(folder), str(self.marker), moment, str(size), str(step)]
        self.elsewhere = elsewhere
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["torch", "torch.distributed"])
        # elsewhere: in a PID namespace of its own (a container, or as good as another host:
        # this process cannot tell by its PID whether it lives); it dies with its parent
        self.forked = context.Process(
            target=_write_elsewhere if elsewhere else _write_in_fork,
            args=(arguments, str(self.log)),
            daemon=True,
        )
        self.forked.start()

    @property
    def pid(self) -> int:
        pid = self.forked.pid
        assert pid is not None
        return int(pid)

    def _exitcode(self) -> int | None:
        code: int | None = self.forked.exitcode
        return code

    def _wait(self, timeout_s: float) -> int:
        self.forked.join(timeout_s)
        code = self.forked.exitcode
        assert code is not None, f"writer {self.pid} still running after {timeout_s} s"
        return int(code)

    def wait_paused(self) -> None:
        deadline = time.monotonic() + _WAIT_S
        while not self.marker.exists():
            if self._exitcode() is not None:
                output = self.log.read_text() if self.log.exists() else ""
                raise AssertionError(f"writer exited {self._exitcode()}\n{output}")
            assert time.monotonic() < deadline, "the writer never reached its pause"
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL to the writer itself (elsewhere: the forked process's only child, inside
        the new PID namespace), and wait until it is gone."""
        target = self.pid
        if self.elsewhere:
            children = Path(f"/proc/{target}/task/{target}/children").read_text().split()
            assert len(children) == 1, children
            target = int(children[0])
            namespace = os.readlink(f"/proc/{target}/ns/pid")
            assert namespace != os.readlink("/proc/self/ns/pid"), "the writer is not elsewhere"
        os.kill(target, signal.SIGKILL)
        code = self._wait(30)
        if not self.elsewhere:
            assert code == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while Path(f"/proc/{target}").exists():  # a zombie of its parent's until it reaps it
            assert time.monotonic() < deadline, f"writer {target} still there after SIGKILL"
            time.sleep(0.02)

    def resume(self) -> tuple[int, str]:
        Path(f"{self.marker}.go").touch()
        code = self._wait(_WAIT_S)
        return code, self.log.read_text()

    def close(self) -> None:
        if self._exitcode() is None:
            os.kill(self.pid, signal.SIGKILL)
        self._wait(30)


@pytest.fixture
def writers() -> Iterator[Callable[..., _Writer]]:
    started: list[_Writer] = []

    def start(folder: Path, moment: str, size: int, step: int, elsewhere: bool = False) -> _Writer:
        started.append(_Writer(folder, moment, size, step, elsewhere))
        return started[-1]

    yield start
    for writer in started:
        writer.close()


_ONE = "ckpt-000000001-000000001.pt"  # the first save of step 1, no run named


def _names(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir())


def _temps(folder: Path) -> list[str]:
    return [name for name in _names(folder) if name.endswith(".tmp")]


@pytest.mark.parametrize("moment", MOMENTS)
def test_kill_9_at_any_moment_of_a_save(
    tmp_path: Path, writers: Callable[..., _Writer], moment: str
) -> None:
    folder = tmp_path / "ckpt"
    ddpkit.save_checkpoint(folder, {"w": torch.full((4,), 1.0)}, step=1)
    writer = writers(folder, moment, 8 * MiB, 2)
    writer.wait_paused()
    writer.kill()
    renamed = moment == "renamed"
    temps = _temps(folder)
    assert len(temps) == (0 if renamed else 1), _names(folder)  # the kill left its temp file
    state: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(folder, state) == (2 if renamed else 1)
    for temp in temps:  # the time a restart takes, without waiting for it
        _age(folder / temp, durable.BEAT_STALE_AFTER_S + 60)
    # the next save (another process on this host) removes the dead writer's temporary file
    ddpkit.save_checkpoint(folder, {"w": torch.zeros(1)}, step=3)
    written = [_ONE, *(["ckpt-000000002-000000002.pt"] if renamed else [])]
    assert _names(folder) == [*written, f"ckpt-000000003-00000000{len(written) + 1}.pt"]
    assert ddpkit.load_checkpoint(folder, state) == 3


def test_a_live_writers_temporary_file_is_left_alone(
    tmp_path: Path, writers: Callable[..., _Writer]
) -> None:
    folder = tmp_path / "ckpt"
    ddpkit.save_checkpoint(folder, {"w": torch.ones(1)}, step=1)
    writer = writers(folder, "written-0.5", 8 * MiB, 2)  # another job, mid-save
    writer.wait_paused()
    (theirs,) = _temps(folder)
    ddpkit.save_checkpoint(folder, {"w": torch.ones(1)}, step=3)  # prunes dead writers' only
    assert _temps(folder) == [theirs]
    code, output = writer.resume()
    assert code == 0 and "saved" in output, output  # its file was there to be renamed
    # both saves started after step 1: each is save number 2 (the later step is the newer)
    assert _names(folder) == [_ONE, "ckpt-000000002-000000002.pt", "ckpt-000000003-000000002.pt"]


def _age(path: Path, seconds: float) -> None:
    """Date ``path``'s last write ``seconds`` back: the time a restart takes (a requeue onto
    another node, a container started again), without waiting for it."""
    when = time.time() - seconds
    os.utime(path, (when, when))


@pytest.mark.parametrize("moment", ["pickling", "written-0.01", "written-0.5", "fsynced"])
def test_a_dead_writer_elsewhere_is_cleared_minutes_later(
    tmp_path: Path, writers: Callable[..., _Writer], moment: str
) -> None:
    """A writer in another PID namespace (as good as another node after a requeue) killed
    mid-save: its file goes once it has not been written to for minutes, not a quarter of an
    hour (during which every save on a nearly full disk fails)."""
    folder = tmp_path / "ckpt"
    ddpkit.save_checkpoint(folder, {"w": torch.ones(1)}, step=1)
    writer = writers(folder, moment, 8 * MiB, 2, elsewhere=True)
    writer.wait_paused()
    writer.kill()
    (temp,) = _temps(folder)
    _age(folder / temp, 3 * 60)
    ddpkit.save_checkpoint(folder, {"w": torch.ones(1)}, step=3)
    assert _names(folder) == [_ONE, "ckpt-000000003-000000002.pt"]


def test_a_live_writer_elsewhere_keeps_its_file_however_long_its_save(
    tmp_path: Path, writers: Callable[..., _Writer]
) -> None:
    """A live writer in another PID namespace, mid-save: dated back past every bound (a save
    that has been running for 20 minutes), its file is still left alone, because the writer
    keeps touching it while its save runs."""
    folder = tmp_path / "ckpt"
    ddpkit.save_checkpoint(folder, {"w": torch.ones(1)}, step=1)
    writer = writers(folder, "written-0.5", 8 * MiB, 2, elsewhere=True)
    writer.wait_paused()
    (theirs,) = _temps(folder)
    _age(folder / theirs, 20 * 60)
    deadline = time.monotonic() + _WAIT_S
    while time.time() - (folder / theirs).stat().st_mtime > 60:  # until the writer touches it
        assert time.monotonic() < deadline, "the live writer never touched its temporary file"
        time.sleep(0.05)
    ddpkit.save_checkpoint(folder, {"w": torch.ones(1)}, step=3)
    assert _temps(folder) == [theirs]
    code, output = writer.resume()
    assert code == 0 and "saved" in output, output
    # both saves started after step 1: each is save number 2 (the later step is the newer)
    assert _names(folder) == [_ONE, "ckpt-000000002-000000002.pt", "ckpt-000000003-000000002.pt"]


def test_a_clock_ahead_of_the_file_servers_takes_no_live_writers_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a shared filesystem a file's time is the file server's, and this node's clock may
    be minutes ahead of it (SLURM's munge tolerates 5): the age of a file is measured on the
    filesystem's own clock, not this node's. The skew is faked (this node's clock, as
    durable reads it); the files and their times are real."""
    elsewhere = ".ckpt-000000002.pt.elsewhere~0123abcd.{}.0000aac{}.hb.tmp"
    live, dead = tmp_path / elsewhere.format(100, 1), tmp_path / elsewhere.format(101, 2)
    live.write_bytes(b"being written")  # touched just now: its writer lives
    dead.write_bytes(b"left by a kill -9")
    _age(dead, durable.BEAT_STALE_AFTER_S + 60)
    ahead = types.SimpleNamespace(time=lambda: time.time() + 10 * 60)
    monkeypatch.setattr(durable, "time", ahead)
    ddpkit.save_checkpoint(tmp_path, {"w": torch.ones(1)}, step=1)
    assert _temps(tmp_path) == [live.name]


def test_which_temporary_files_are_stale(tmp_path: Path) -> None:
    """The rule of ckptfiles.remove_stale_temps, file by file: by age alone, whoever wrote it:
    minutes for a writer that touches its file while it writes (".hb"), a quarter of an hour
    for any other name (an older ddpkit's, a hand-made one)."""
    now = time.time()
    fresh, old = now - durable.STALE_AFTER_S + 120, now - durable.STALE_AFTER_S - 120
    fresh_beat = now - durable.BEAT_STALE_AFTER_S + 60
    old_beat = now - durable.BEAT_STALE_AFTER_S - 60
    cases = {  # name: (last written, stays)
        ".ckpt-000000002.pt.0000aab1.hb.tmp": (old_beat, False),
        ".ckpt-000000002.pt.0000aab2.hb.tmp": (fresh_beat, True),
        # the names of the ddpkit before this one: host, PID namespace and PID in them
        ".ckpt-000000002.pt.elsewhere~0123abcd.41.0000aab3.hb.tmp": (old_beat, False),
        ".ckpt-000000002.pt.elsewhere~0123abcd.42.0000aab4.hb.tmp": (fresh_beat, True),
        ".ckpt-000000002.pt.0a1b2c3d.tmp": (fresh, True),  # ddpkit before the heartbeat
        ".ckpt-000000002.pt.0a1b2c3d.tmp.x": (old, True),  # not a temporary file name
        ".ckpt-000000003.pt.0a1b2c3e.tmp": (old, False),
        ".other-000000002.pt.0a1b2c3f.tmp": (old, True),  # not a checkpoint's
    }
    for entry, (when, _) in cases.items():
        (tmp_path / entry).write_bytes(b"partial")
        os.utime(tmp_path / entry, (when, when))
    target = tmp_path / "target"
    target.write_text("kept")
    (tmp_path / ".ckpt-000000004.pt.0a1b2c40.tmp").symlink_to(target)
    os.utime(tmp_path / ".ckpt-000000004.pt.0a1b2c40.tmp", (old, old), follow_symlinks=False)
    ddpkit.save_checkpoint(tmp_path, {"w": torch.ones(1)}, step=1)
    left = set(_names(tmp_path))
    for entry, (_, stays) in cases.items():
        assert (entry in left) == stays, entry
    assert ".ckpt-000000004.pt.0a1b2c40.tmp" in left and target.read_text() == "kept"


# --- a small disk ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``mount(size)``: a fresh tmpfs of ``size`` (e.g. "8m"), unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        target = tmp_path / f"disk{len(mounted)}"
        target.mkdir()
        command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)]
        try:
            done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=30)
            why = done.stderr.strip() if done.returncode else ""
        except FileNotFoundError as error:
            why = str(error)
        if why:
            missing(f"cannot mount a {size} tmpfs for the disk-full tests (needs root): {why}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        unmounted = subprocess.run(["umount", str(target)], check=False, capture_output=True)
        if unmounted.returncode:  # still busy: detach it now, it goes once its last user does
            subprocess.run(["umount", "-l", str(target)], check=True)


@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_dead_writers_file_does_not_fill_a_small_disk_for_long(
    small_disk: Callable[[str], Path], writers: Callable[..., _Writer], elsewhere: bool
) -> None:
    """The issue's case across a restart (here, or elsewhere: a writer in another PID
    namespace): a nearly full disk, a writer killed at 90% of its save, leaving a 3.6 MiB
    temporary file (2.5 + 3.6 + 2.5 > 8), the next save three minutes later."""
    folder = small_disk("8m") / "ckpt"
    checkpoint = {"w": torch.ones(int(2.5 * MiB) // 4)}  # 2.5 MiB
    ddpkit.save_checkpoint(folder, checkpoint, step=1)
    writer = writers(folder, "written-0.9", 4 * MiB, 2, elsewhere=elsewhere)
    writer.wait_paused()
    writer.kill()
    (temp,) = _temps(folder)
    assert shutil.disk_usage(folder).free < 2.5 * MiB
    _age(folder / temp, 3 * 60)
    ddpkit.save_checkpoint(folder, checkpoint, step=3)
    assert _names(folder) == [_ONE, "ckpt-000000003-000000002.pt"]
    assert ddpkit.load_checkpoint(folder, {}) == 3


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_says_how_much_space_is_missing(
    small_disk: Callable[[str], Path], mode: str
) -> None:
    folder = small_disk("8m") / "ckpt"
    ddpkit.save_checkpoint(folder, {"w": torch.ones(3 * MiB // 4)}, step=1)
    free_before = shutil.disk_usage(folder).free
    big = {"w": torch.ones(6 * MiB // 4)}
    with pytest.raises(CheckpointError) as caught:
        if mode == "sync":
            ddpkit.save_checkpoint(folder, big, step=2)
        else:  # the background write's failure, raised by the wait
            ddpkit.async_save_checkpoint(folder, big, step=2).wait()
    message = str(caught.value)
    found = re.search(
        rf"no space left on device \((\d+) MB needed, (\d+) MB free in {folder}\)", message
    )
    assert found is not None, message
    needed, free = int(found[1]), int(found[2])
    assert needed == -(-6 * MiB // 10**6) and free == free_before // 10**6, message
    assert "unexpected pos" not in message and "keep_last" in (caught.value.hint or "")
    assert _names(folder) == [_ONE]  # nothing half-written left
    assert ddpkit.load_checkpoint(folder, {}) == 1
