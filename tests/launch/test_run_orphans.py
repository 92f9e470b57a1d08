"""Workers die with their launcher, whatever kills it: kill -9 of `ddpkit run` at many moments.

A real ``ddpkit run --nproc-per-node 2`` of ``tests/scripts/long_worker.py`` (which never ends by
itself and writes its pid and its phase into a folder) gets SIGKILL at a given moment: a fixed
delay after its start (before any worker exists, while torch's agent starts them), once a worker
has started (before its loop: importing torch), during training in the middle of a checkpoint
write, during the agent's teardown of a failed group (a worker that saves on SIGTERM). Then no
process of the run may remain a few seconds later: neither the workers (by their pid files, and
by the folder in their command line, which also finds a worker killed before it wrote its pid)
nor, for a ``--no-python`` wrapper command, the wrapper's own child. And the
checkpoint that was being written is never completed by a worker outliving its launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.pids import signal_if_same, start_ticks

# mostly waiting for processes to end: run beside the SLURM tests (ci/test.sh)
pytestmark = [pytest.mark.multiproc, pytest.mark.sidecar]

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "scripts" / "long_worker.py")
MOMENT_TIMEOUT_S = 120.0  # a loaded 2-core machine: torch imports take seconds
GONE_WITHIN_S = 10.0  # death is immediate; this only bounds the machine's slowness


def _env() -> dict[str, str]:
    kept = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPKIT_", "PET_"))}
    return {**kept, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _run_processes(where: Path) -> set[int]:
    """Every process of the run now: the command lines naming the run's folder. Not its pid
    files: a pid outlives its worker, and may name another test's process by then (the clean-up
    below once killed one)."""
    pids: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if str(where).encode() in (entry / "cmdline").read_bytes():
                pids.add(int(entry.name))
    return pids


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[1])


def _phase(*names: str) -> Callable[[Path], bool]:
    return lambda where: all((where / name).exists() for name in names)


def _after(seconds: float) -> Callable[[Path], bool]:
    start = time.monotonic()
    return lambda where: time.monotonic() - start >= seconds


# (launcher flags, worker arguments, moment): from the launcher's first instant (before torch's
# agent exists) to a checkpoint half written; --run-path workers are multiprocessing children.
Moment = tuple[list[str], list[str], Callable[[], Callable[[Path], bool]]]
MOMENTS: dict[str, Moment] = {
    "at-once": ([], [], lambda: _after(0.0)),
    "0.5s": ([], [], lambda: _after(0.5)),
    "1.5s": ([], [], lambda: _after(1.5)),
    "3s": ([], [], lambda: _after(3.0)),
    "worker-started": ([], ["--torch"], lambda: _phase("phase.0.start")),
    # mid-write, so mid-training too: both ranks in their loop (torch-free: what must die is
    # the process, gloo or not; "worker-started" kills workers importing torch)
    "checkpoint": ([], [], lambda: _phase("phase.0.ckpt")),
    "run-path-training": (["--run-path"], [], lambda: _phase("phase.0.loop", "phase.1.loop")),
    # teardown: rank 1 failed, the agent's SIGTERM has reached rank 0, which saves slowly on it
    "teardown-at-once": ([], ["--teardown"], lambda: _phase("phase.0.term")),
    "teardown-mid-save": ([], ["--teardown"], lambda: _phase("phase.0.term", "ckpt.0.tmp")),
    "run-path-teardown": (["--run-path"], ["--teardown"], lambda: _phase("phase.0.term")),
}


def _launch(command: list[str], where: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=_env(),
        stdout=(where / "launcher.out").open("wb"),
        stderr=(where / "launcher.err").open("wb"),
        start_new_session=True,  # the test's own cleanup can reach what it leaves
    )


@dataclass
class Watched:
    parents: dict[int, int | None]  # the parent of each process with a pid file, at the kill
    survivors: set[int]  # alive GONE_WITHIN_S after the kill
    saved: list[str]  # completed checkpoints at the kill
    later: list[str]  # and a second after everything was gone


def _kill_and_watch(
    run: subprocess.Popen[bytes], where: Path, moment: Callable[[Path], bool]
) -> Watched:
    """SIGKILL the launcher at ``moment``, then watch what remains of the run."""
    deadline = time.monotonic() + MOMENT_TIMEOUT_S
    while not moment(where):
        assert run.poll() is None, f"the launcher ended first: {_output(where)}"
        assert time.monotonic() < deadline, f"the moment never came: {_output(where)}"
        time.sleep(0.005)
    parents = {int(path.name.split(".")[1]): None for path in where.glob("pid.*")}
    parents = {pid: _parent(pid) for pid in parents}
    run.kill()
    run.wait()
    saved = sorted(path.name for path in where.glob("ckpt-*"))
    gone_by = time.monotonic() + GONE_WITHIN_S
    while any(_alive(pid) for pid in _run_processes(where)) and time.monotonic() < gone_by:
        time.sleep(0.05)
    time.sleep(1.0)  # a survivor would go on writing: give it the time to finish a save
    survivors = {pid for pid in _run_processes(where) if _alive(pid)}
    return Watched(parents, survivors, saved, sorted(path.name for path in where.glob("ckpt-*")))


def _output(where: Path) -> str:
    return "".join(
        (where / name).read_text(errors="replace") for name in ("launcher.out", "launcher.err")
    )


def _clean(where: Path) -> None:
    for pid in _run_processes(where):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("name", list(MOMENTS))
def test_kill_9_of_the_launcher_takes_its_workers_with_it(tmp_path: Path, name: str) -> None:
    flags, extra, moment = MOMENTS[name]
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", *flags, WORKER]
    run = _launch([*command, str(tmp_path), *extra], tmp_path)
    try:
        seen = _kill_and_watch(run, tmp_path, moment())
    finally:
        run.kill()
        run.wait()
        _clean(tmp_path)
    alive = sorted(seen.survivors)
    assert not alive, f"{name}: alive {GONE_WITHIN_S}s after kill -9: {alive}"
    assert seen.later == seen.saved, f"{name}: checkpoints completed after the kill: {seen.later}"
    if name in ("checkpoint", "run-path-training"):  # what the parent-death signal relies on
        assert set(seen.parents.values()) == {run.pid}, (run.pid, seen.parents)


def test_kill_9_of_the_launcher_takes_a_wrapper_commands_children_too(tmp_path: Path) -> None:
    """``--no-python sh -c "python train.py; ..."``: the wrapper is the worker, the training
    process its child (a command that does not ``exec``); both must go."""
    wrapper = f'"{sys.executable}" "{WORKER}" "{tmp_path}"; echo done'
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "--no-python"]
    run = _launch([*command, "sh", "-c", wrapper], tmp_path)
    try:
        seen = _kill_and_watch(run, tmp_path, _phase("phase.0.loop", "phase.1.loop"))
    finally:
        run.kill()
        run.wait()
        _clean(tmp_path)
    assert not seen.survivors, f"alive {GONE_WITHIN_S}s after kill -9: {sorted(seen.survivors)}"
    assert run.pid not in seen.parents.values()  # the training processes were grandchildren
    assert "ddpkit: the launcher (pid " in _output(tmp_path)  # the sweeper's line


# --- the two mechanisms one at a time, without torch ----------------------------------------------

PDEATHSIG_OF_SELF = (
    "import ctypes, os; value = ctypes.c_int(); "
    "ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0); print(os.getpid(), value.value)"
)


def test_the_stub_sets_the_parent_death_signal_and_execs_in_place() -> None:
    from ddpkit.launch import deathsig

    entrypoint, args = deathsig.tie(sys.executable, ("-c", PDEATHSIG_OF_SELF))
    done = subprocess.run([entrypoint, *args], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    pid, death_signal = map(int, done.stdout.split())
    assert death_signal == signal.SIGKILL  # PR_GET_PDEATHSIG after the exec
    assert pid > 0 and done.stderr == ""


def test_the_stub_does_not_start_a_worker_whose_launcher_is_gone(tmp_path: Path) -> None:
    """The launcher died between the fork and the prctl: the parent is no longer the one the
    stub was told; the command must not run (no signal would ever stop it)."""
    from ddpkit.launch import deathsig

    ran = tmp_path / "ran"
    entrypoint, args = deathsig.tie("touch", (str(ran),), launcher=os.getpid() + 1_000_000)
    done = subprocess.run([entrypoint, *args], capture_output=True, text=True, check=False)
    assert done.returncode == -signal.SIGKILL, done
    assert "is gone before this worker started" in done.stderr
    assert not ran.exists()


def test_the_stub_reports_a_command_it_cannot_run() -> None:
    from ddpkit.launch import deathsig

    entrypoint, args = deathsig.tie("no-such-command-ddpkit", ())
    done = subprocess.run([entrypoint, *args], capture_output=True, text=True, check=False)
    assert done.returncode == 127
    assert "ddpkit: cannot run 'no-such-command-ddpkit'" in done.stderr


# A parent (the "launcher") starts one worker through the stub and, under tied(), one process
# without it but with the token (a worker's own child), plus one with neither; then it dies of
# SIGKILL, or leaves the block normally. Each prints its pid to the pipe.
PARENT = """
import os, signal, subprocess, sys, time
from ddpkit.launch import deathsig
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
with deathsig.tied() as token:
    entrypoint, args = deathsig.tie(sleeper[0], tuple(sleeper[1:]))
    tied = subprocess.Popen([entrypoint, *args])
    marked = subprocess.Popen(sleeper, env={**os.environ, deathsig.TOKEN_VAR: token},
                              start_new_session=True)
    other = subprocess.Popen(sleeper, start_new_session=True)
    print(tied.pid, marked.pid, other.pid, flush=True)
    time.sleep(1.0)  # the stub's exec
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    tied.kill(); tied.wait()
print("left the block", flush=True)
"""


@pytest.mark.parametrize("end", ["kill", "normal"])
def test_parent_death_signal_and_sweeper_on_their_own(end: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, end], env=_env(), stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    tied, marked, other = map(int, parent.stdout.readline().split())
    started = {pid: start_ticks(pid) for pid in (tied, marked, other)}  # all three run now

    def alive(pid: int) -> bool:  # that process, not one that got its pid after it ended
        return _alive(pid) and start_ticks(pid) == started[pid]

    try:
        parent.wait(timeout=60)
        gone_by = time.monotonic() + GONE_WITHIN_S
        while (alive(tied) or (end == "kill" and alive(marked))) and time.monotonic() < gone_by:
            time.sleep(0.05)
        if end == "kill":  # the stub's worker by the kernel, the marked one by the sweeper
            assert parent.returncode == -signal.SIGKILL
            assert not alive(tied) and not alive(marked)
        else:  # a launcher that ends normally has stopped its workers itself: no sweep
            assert parent.returncode == 0
            assert alive(marked)
        assert alive(other)  # never a process without the token
    finally:
        for pid, ticks in started.items():
            signal_if_same(pid, ticks)
