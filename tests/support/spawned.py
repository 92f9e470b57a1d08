"""Ranks as real processes: one process per rank with torchrun's variables in its own
environment (so that each rank's stderr and exit code can be read), and whether a pid runs.

:func:`spawn` starts a new interpreter per rank; :func:`forked` forks each rank from the fork
server of :mod:`tests.support.distutil` (torch imported once) and runs the script as
``__main__``, ending as an interpreter ends (its threads, then its atexit handlers), without
the ~2 CPU-s of a new interpreter's ``import torch``. Use :func:`spawn` only where what is
checked happens after atexit (the interpreter's finalization)."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import re
import runpy
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.distutil import FORKSERVER_PRELOAD, free_port

ROOT = Path(__file__).resolve().parents[2]
_FOREIGN_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "MV2_", "PET_", "TORCHELASTIC_", "SUBMITIT_")


@dataclass
class Rank:
    rank: int
    code: int
    out: str
    err: str
    ended_s: float  # seconds after the start of all ranks

    def pid(self) -> int:
        return int(re.findall(rf"^pid {self.rank} (\d+)$", self.out, re.MULTILINE)[0])

    def children(self) -> list[tuple[int, int]]:
        """The children the rank printed: (pid, start time) each (``children PID:TICKS ...``)."""
        found = re.findall(r"^children ([\d: ]+)$", self.out, re.MULTILINE)
        pairs = [item.split(":") for item in found[0].split()] if found else []
        return [(int(pid), int(ticks)) for pid, ticks in pairs]


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_FOREIGN_PREFIXES) and not k.startswith("DDPKIT_")
    }
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return {**env, **extra}


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has ended; only its exit status waits to be read)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def spawned_env(
    rank: int, world_size: int, port: int, bound_s: float, env: dict[str, str] | None
) -> dict[str, str]:
    """A rank's environment: torchrun's variables of a one-node job, the peer bound, ``env``."""
    return child_env(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DDPKIT_PEER_TIMEOUT=f"{bound_s:g}",
        **(env or {}),
    )


def wait_ended(
    exit_codes: list[Callable[[], int | None]],
    expect_stuck: tuple[int, ...],
    started: float,
    timeout_s: float,
) -> dict[int, float]:
    """Seconds from ``started`` at which each rank ended (``exit_codes[r]()`` not None), until
    every rank not in ``expect_stuck`` has or ``timeout_s`` passed; the stuck ones get now."""
    ended: dict[int, float] = {}
    deadline = started + timeout_s
    waiting = [r for r in range(len(exit_codes)) if r not in expect_stuck]
    while waiting and time.monotonic() < deadline:
        for r in list(waiting):
            if exit_codes[r]() is not None:
                ended[r] = time.monotonic() - started
                waiting.remove(r)
        time.sleep(0.05)
    for r in expect_stuck:
        ended[r] = time.monotonic() - started
    return ended


def spawn(
    script: Path,
    world_size: int,
    args: list[str],
    *,
    bound_s: float,
    expect_stuck: tuple[int, ...] = (),
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Rank]:
    """Run ``script`` as ranks 0..world_size-1; ranks in ``expect_stuck`` are killed once the
    others are done (a frozen rank cannot end itself). Nothing is left running afterwards.
    ``timeout_s`` is a guard against a hang, not a measure: a rank still running then is killed
    (exit code -9), which the tests read as "did not end on its own"."""
    port = free_port()
    procs = []
    started = time.monotonic()
    for rank in range(world_size):
        rank_env = spawned_env(rank, world_size, port, bound_s, env)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs: dict[int, tuple[str, str]] = {}
    ended: dict[int, float] = {}
    readers = [
        threading.Thread(target=lambda r=r: outputs.__setitem__(r, procs[r].communicate()))
        for r in range(world_size)
    ]
    for reader in readers:
        reader.start()
    try:
        ended = wait_ended([proc.poll for proc in procs], expect_stuck, started, timeout_s)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for reader in readers:
            reader.join()
    return [
        Rank(r, procs[r].returncode, *outputs[r], ended.get(r, float("inf")))
        for r in range(world_size)
    ]


def _rank_main(script: str, args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """One rank, in a process forked from the fork server: ``python script *args`` with
    ``env`` as its environment and its stdout and stderr into ``out`` and ``err``, ended as an
    interpreter ends (its code, or 1 after ``sys.excepthook`` for what it raised)."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):  # faulthandler and C++ write to the fds themselves
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    mp.set_start_method("fork", force=True)  # a fresh interpreter's default here (DataLoader)
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as an interpreter does: ddpkit's watchdog chains it
        code = 1
    # what an interpreter's exit runs next: it waits for its other threads, then atexit's
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def forked(
    script: Path,
    world_size: int,
    args: list[str],
    *,
    bound_s: float,
    expect_stuck: tuple[int, ...] = (),
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Rank]:
    """:func:`spawn`'s contract, with ranks forked from the fork server: ranks in
    ``expect_stuck`` are killed once the others are done; ``timeout_s`` is a guard against a
    hang, not a measure (a rank still running then is killed: exit code -9). Each rank's
    stdout and stderr go to ``rank<r>.out`` and ``rank<r>.err`` beside ``script``. Nothing is
    left running afterwards."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    port = free_port()
    procs = []
    started = time.monotonic()
    for rank in range(world_size):
        rank_env = spawned_env(rank, world_size, port, bound_s, env)
        out, err = (str(script.parent / f"rank{rank}.{kind}") for kind in ("out", "err"))
        proc = context.Process(
            target=_rank_main, args=(str(script), args, rank_env, out, err), name=f"rank{rank}"
        )
        proc.start()
        procs.append(proc)
    ended: dict[int, float] = {}
    try:
        exit_codes = [lambda proc=proc: proc.exitcode for proc in procs]
        ended = wait_ended(exit_codes, expect_stuck, started, timeout_s)
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
    ranks = []
    for r, proc in enumerate(procs):
        assert proc.exitcode is not None  # joined
        out, err = ((script.parent / f"rank{r}.{kind}").read_text() for kind in ("out", "err"))
        ranks.append(Rank(r, proc.exitcode, out, err, ended.get(r, float("inf"))))
    return ranks
