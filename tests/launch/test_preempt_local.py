"""The stop signal under ``ddpkit run``: the launcher passes SIGUSR2 on, the run stops with 75.

``examples/train.py`` runs as 2 workers, three times on one checkpoint folder, each launch under
a storm of SIGUSR2 (``DDPKIT_SIGNAL=USR2``, as in a ddpkit job) from a different moment to the
run's end: the stop signal at any moment never kills a process. Each launch starts three
interpreters that import torch, so the moments share them:

1. from the launcher's start, to the launcher and every worker (hit while Python and torch
   start, before and during their ``init()``): the run stops at its first step, with 75;
2. from training, once the run (resumed from 1's checkpoint) saved one of its own: to the
   ``ddpkit run`` process alone until rank 0 said the ranks agreed to stop (which only the
   launcher's passing the signal on can have caused), then to every process. The launcher
   exits with 75 and leaves no worker behind;
3. from the evaluation (after the last step: it leaves the run as it was, and covers the
   teardown), of the same command run again: it resumes from 2's stop and ends with the
   weights of an uninterrupted run, the same training in 2 ranks forked from the test's fork
   server (a reference, not the launch under test: two forks of a process that imported torch
   once, not a launch's three fresh interpreters).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path

import pytest

from ddpkit.cluster.stop.forward import child_pids
from ddpkit.contract import STOP_HOLD_MODULE
from tests.support.distutil import run_workers, torchrun_env
from tests.support.pids import signal_if_same, start_ticks

pytestmark = pytest.mark.sidecar  # mostly waiting: run beside the SLURM tests (ci/test.sh)

ROOT = Path(__file__).resolve().parents[2]
# 2000 samples over 2 ranks in batches of 64: 16 steps an epoch, 32 in all.
TRAIN = ["examples/train.py", "--epochs", "2", "--train-size", "2000", "--test-size", "501"]
CHECKPOINT = re.compile(r"ckpt-(\d{9})-\d{9}.*\.pt")  # step, save number, run
# "[rank0]: " is the launcher's prefix; the forked reference's rank 0 prints without it
HASH = re.compile(r"^(?:\[rank0\]:? ?)?weights sha256: ([0-9a-f]{64})$", re.MULTILINE)
RESUMED = re.compile(r"^\[rank0\]:? ?resumed from .* at step (\d+)", re.MULTILINE)
SAVED = re.compile(r"^\[rank0\]:? ?stop signal: saved step (\d+) in ", re.MULTILINE)
TIMEOUT_S = 90.0


def _env() -> dict[str, str]:
    kept = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPKIT_", "SUBMITIT_"))
    }
    return {**kept, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def _command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", *TRAIN, *extra]


def _start(command: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    # into files: a pipe nobody reads while we poll could fill up and stall the run
    with out.with_suffix(".out").open("w") as stdout, out.with_suffix(".err").open("w") as stderr:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env={**_env(), **env},
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )


def _logs(out: Path) -> tuple[str, str]:
    return out.with_suffix(".out").read_text(), out.with_suffix(".err").read_text()


def _worker_pids(marker: str) -> list[int]:
    """Processes other than the launcher with ``marker`` as an argument."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError):  # not a process, or it just ended
            continue
        if marker in argv and "-m" not in argv:
            pids.append(int(entry.name))
    return sorted(pids)


def _kill(run: subprocess.Popen[str], marker: str) -> None:
    """Kill a launcher and any worker it left (workers run in sessions of their own)."""
    run.kill()
    run.wait()
    for pid in _worker_pids(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _steps_saved(directory: Path) -> list[int]:
    names = os.listdir(directory) if directory.is_dir() else []
    return sorted(int(m[1]) for m in map(CHECKPOINT.fullmatch, names) if m)


def _final_hash(stdout: str) -> str:
    found = HASH.findall(stdout)
    assert len(found) == 1, stdout
    return str(found[0])


@dataclass(frozen=True)
class Storm:
    code: int  # the launcher's exit code
    sent: int  # rounds of signals
    out: str
    err: str


@dataclass(frozen=True)
class Runs:
    """The three launches (by the moment their storm started from) and the weights of an
    uninterrupted run."""

    storms: dict[str, Storm]  # "start", "training" (the stopped run), "evaluation" (the rerun)
    leftovers: list[int]  # the stopped run's workers still alive after it exited
    steps_saved: list[int]  # the checkpoints' steps after the stopped run
    reference: str  # the uninterrupted run's stdout

    @property
    def stopped(self) -> Storm:
        return self.storms["training"]

    @property
    def rerun(self) -> Storm:
        return self.storms["evaluation"]


AGREED = "SIGUSR2 received: every rank stops after this step"  # rank 0, once the ranks agreed


def _launch(
    out: Path,
    command: list[str],
    marker: str,
    started: Callable[[Path], bool],
    everyone: Callable[[], bool] = lambda: True,
) -> tuple[Storm, list[int]]:
    """Run ``command`` under a storm that starts once ``started(latched)`` (the launcher's
    latch folder) holds: what it ended with, and its workers still alive after its exit."""
    latched = out.with_name(f"{out.name}-latched")
    latched.mkdir()
    run = _start(command, out, {"DDPKIT_SIGNAL": "USR2", "DDPKIT_LATCH_DIR": str(latched)})
    try:
        sent = _storm(run, lambda: started(latched), everyone)
        run.wait(timeout=TIMEOUT_S)
        leftovers = _worker_pids(marker)
    finally:
        _kill(run, marker)  # and any leftover, before the next launch uses the same folder
    return Storm(run.returncode, sent, *_logs(out)), leftovers


def _latched(latched: Path) -> bool:
    return bool(os.listdir(latched))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp_path = tmp_path_factory.mktemp("preempt-local")
    directory = tmp_path / "stop-ckpt"  # unique: marks this test's workers in /proc
    marker = str(directory)
    command = _command("--checkpoint-dir", marker, "--checkpoint-every", "5")
    storms = {}
    # 1. every process, from the launcher's latch on: the signal is there before the loop
    storms["start"], _ = _launch(
        tmp_path / "start", [*command, "--step-delay", "0.02"], marker, _latched
    )
    before = max(_steps_saved(directory), default=0)

    def saved_anew(_: Path) -> bool:  # a checkpoint of this run's own, with both workers up
        if max(_steps_saved(directory), default=0) <= before:
            return False
        assert len(_worker_pids(marker)) == 2, "expected the 2 workers to be running"
        return True

    # 2. the launcher only, until the ranks agreed; then every process, until the exit. 27
    # steps of 0.1 s after the first save: the stop comes long before the end
    out = tmp_path / "training"
    storms["training"], leftovers = _launch(
        out, [*command, "--step-delay", "0.1"], marker, saved_anew,
        everyone=lambda: AGREED in _logs(out)[1],
    )  # fmt: skip
    steps_saved = _steps_saved(directory)
    # 3. every process, from the evaluation's line on: the rerun, which resumes from 2's stop
    out = tmp_path / "evaluation"
    storms["evaluation"], _ = _launch(
        out, [*command, "--step-delay", "0.02"], marker,
        lambda _: bool(EVALUATION.search(_logs(out)[0])),
    )  # fmt: skip
    reference = run_workers(_uninterrupted, 2, timeout_s=TIMEOUT_S)[0]
    return Runs(storms, leftovers, steps_saved, reference)


EVALUATION = re.compile(r"^\[rank0\]:? ?epoch 1: ", re.MULTILINE)  # after the last step


def _uninterrupted(rank: int, world_size: int, port: int) -> str:
    """Rank ``rank`` of the training the launches run, never stopped: its stdout (one thread
    and no stop signal, as in a launched worker)."""
    for name in [k for k in os.environ if k.startswith(("SLURM_", "DDPKIT_", "SUBMITIT_"))]:
        del os.environ[name]
    os.environ.update(torchrun_env(rank, world_size, port, OMP_NUM_THREADS="1"))
    import torch

    import ddpkit

    torch.set_num_threads(1)
    said = io.StringIO()
    sys.argv = [str(ROOT / TRAIN[0]), *TRAIN[1:]]
    try:
        with contextlib.redirect_stdout(said):
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        ddpkit.shutdown()
    return said.getvalue()


@pytest.mark.multiproc
@pytest.mark.slow
def test_sigusr2_to_the_launcher_reaches_the_workers_which_stop_with_75(runs: Runs) -> None:
    stopped = runs.stopped
    assert stopped.code == 75, f"exit {stopped.code}\n{stopped.out}\n{stopped.err}"
    assert runs.leftovers == [], f"workers left behind: {runs.leftovers}"
    assert AGREED in stopped.err, stopped.err
    assert "not a SLURM job" in stopped.err, stopped.err
    assert not HASH.search(stopped.out), stopped.out  # it did stop before the end
    saved = [int(step) for step in SAVED.findall(stopped.err)]
    assert len(saved) == 1 and saved[0] < 32, stopped.err
    assert runs.steps_saved[-1:] == saved, (runs.steps_saved, stopped.err)


@pytest.mark.multiproc
@pytest.mark.slow
def test_launcher_reports_the_stop_as_stopped_early_with_a_checkpoint(runs: Runs) -> None:
    # Both workers exit 75, a few ms apart: torch's agent must not SIGTERM the slower one
    # (whose "signal SIGTERM" would turn the report into "worker failed (root cause)").
    for name in ("start", "training"):
        storm = runs.storms[name]
        assert storm.code == 75, (name, storm.err)
        assert "stopped early with a checkpoint" in storm.err, (name, storm.err)
        assert "worker failed" not in storm.err, (name, storm.err)


@pytest.mark.multiproc
@pytest.mark.slow
def test_rerun_resumes_from_the_stop_to_the_weights_of_an_uninterrupted_run(runs: Runs) -> None:
    start, stopped, rerun = runs.storms["start"], runs.stopped, runs.rerun
    assert rerun.code == 0, f"{rerun.out}\n{rerun.err}"
    for first, then in ((start, stopped), (stopped, rerun)):  # each resumed where the last stopped
        saved = [int(step) for step in SAVED.findall(first.err)]
        assert len(saved) == 1, first.err
        assert [int(step) for step in RESUMED.findall(then.out)] == saved, then.out
    assert _final_hash(rerun.out) == _final_hash(runs.reference), runs.reference


def test_child_pids_lists_direct_children_but_not_grandchildren() -> None:
    plain = subprocess.Popen(["sleep", "60"])
    parent = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True
    )
    grandchild, grandchild_started = None, None
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        grandchild_started = start_ticks(grandchild)  # `sleep 60` runs now
        found = child_pids()
        assert {plain.pid, parent.pid} <= set(found), found
        assert grandchild not in found and os.getpid() not in found, found
        assert found == sorted(found)
        assert child_pids(parent.pid) == [grandchild]
        assert child_pids(grandchild) == []
    finally:
        if grandchild is not None:
            signal_if_same(grandchild, grandchild_started)
        for child in (plain, parent):
            child.kill()
            child.wait()
    assert plain.pid not in child_pids() and parent.pid not in child_pids()


def test_child_pids_reads_ppid_after_the_last_parenthesis(tmp_path: Path) -> None:
    """``/proc/<pid>/stat`` is ``pid (comm) state ppid``; comm may hold spaces and ')'."""
    stats = {
        "100": "100 (python) S 1 100 100 0",
        "101": "101 (odd name) S 100 1 1 0",
        "102": "102 (tricky) S 100 (x) S 7 1 1 0",  # its parent is 7, not 100
        "103": "103 (w) S 100",
        "104": "104 (w) S 1000 1 1 0",
        "105": "105 (ok) S 100 1 1 0",
    }
    for pid, text in stats.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "stat").write_text(text + "\n")
    (tmp_path / "106").mkdir()  # ended meanwhile: no stat
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "stat").write_text("100 (python) S 100 1 1 0\n")
    assert child_pids(100, proc=str(tmp_path)) == [101, 103, 105]
    assert child_pids(7, proc=str(tmp_path)) == [102]
    assert child_pids(100, proc=str(tmp_path / "missing")) == []


# A stop signal at any moment from the launcher's start to the exit: a storm of SIGUSR2 (one to
# the launcher and to each worker every 10 ms, as SLURM signals every process of a step)
# starts at a given moment and lasts until the launcher has exited. "start": once the launcher
# holds the signal (its marker in DDPKIT_LATCH_DIR), before its workers exist, so they are hit
# while Python and torch start, and on through their init(): training that sees it stops with
# 75 (the storm from training is the stopped run: to the launcher alone until the ranks
# agreed); a storm that starts after the last step meets the evaluation and then the teardown
# (the weights line, atexit, the interpreter's finalization, the launcher's own exit: a storm
# lasts to the end, so one from the evaluation covers the teardown too), and the run ends 0.
ROUND_S = 0.01  # between two rounds of signals
REFRESH = 10  # rounds between two reads of the run's processes (a read scans /proc)
# (was: a round each millisecond, each reading the processes first: at a load of 30 one
# read of a process's children took 59 ms here, so a round came every ~0.2 s; a round each
# millisecond without the reads slowed the runs past the 90-s guard at a load of 34)


def _storm(
    run: subprocess.Popen[str],
    started: Callable[[], bool],
    everyone: Callable[[], bool] = lambda: True,
) -> int:
    """Wait until ``started()``, then signal the run until it exits; how many rounds were
    sent (each a signal to the launcher and, once ``everyone()`` held, to each of its
    descendants)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not started():
        assert run.poll() is None, "the run ended before the storm"
        assert time.monotonic() < deadline, "the storm's moment never came"
        time.sleep(0.005)
    sent, pids, all_of_them = 0, [], False
    while run.poll() is None:
        if sent % REFRESH == 0:  # new workers join the storm within 10 rounds
            all_of_them = all_of_them or everyone()
            pids = [run.pid, *(_descendants(run.pid) if all_of_them else [])]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
        sent += 1
        time.sleep(ROUND_S)
        assert time.monotonic() < deadline, "the run did not end"
    return sent


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``: one pass over /proc for the whole tree (``child_pids`` per
    process would read every process's stat once for each process of the run)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # it just ended
            continue
        parent = int(stat[stat.rfind(")") + 2 :].split()[1])  # comm may hold spaces and ')'
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_stop_signal_at_any_moment_never_kills_a_process(runs: Runs) -> None:
    for name, (code, sent, stdout, stderr) in ((k, astuple(v)) for k, v in runs.storms.items()):
        where = f"storm from {name}: exit {code}, {sent} rounds of signals sent\n{stdout}\n{stderr}"
        assert sent > 0, where
        stopped = "every rank stops after this step" in stderr
        assert code == (75 if stopped else 0), where
        assert "worker failed" not in stderr and "Signal" not in stderr, where
        assert stopped or len(HASH.findall(stdout)) == 1, where
        if name == "start":  # the signal was there before the loop: stopped at the first step
            assert stopped and code == 75, where
        if name == "evaluation":  # its line comes after the last should_stop
            assert code == 0, where


# The task wrapper of ddpkit's sbatch scripts, as rendered, run here under bash: the command's
# Python is signalled (with the wrapper, as SLURM signals every process of a step) before it has
# latched the signal; it must not die, and must get the signal once it has latched it. A SIGTERM
# must not end the wrapper before the command (SLURM would then kill the rest of the task).
LATE_CHILD = """
import os, signal, sys
print(f"child: starting {os.getpid()}", flush=True)
sys.stdin.readline()  # the test sends the line once the signals are out
print(f"child: SIGINT {signal.getsignal(signal.SIGINT).__name__}", flush=True)
from ddpkit.cluster.stop import latch as stopsignal
stopsignal.latch_from_env(os.environ)
import time
deadline = time.monotonic() + 10
while not stopsignal.received(signal.SIGUSR2) and time.monotonic() < deadline:
    time.sleep(0.005)
print(f"child: received {stopsignal.received(signal.SIGUSR2)}", flush=True)
sys.stdin.readline()  # the test sends the line once it has sent the wrapper a SIGTERM
sys.exit(3)
"""


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_the_task_wrapper_holds_a_signal_until_the_command_has_latched_it(
    tmp_path: Path, launch: str
) -> None:
    from ddpkit.jobs.render import render_sbatch
    from ddpkit.jobs.spec import JobSpec

    job = JobSpec(name="w", command=["train.py"], workdir=str(tmp_path), launch=launch)
    holder = f" -m {STOP_HOLD_MODULE} "
    assert holder in render_sbatch(job), "no task wrapper in the script"
    latched = tmp_path / "latched"
    latched.mkdir()
    wrapper = subprocess.Popen(
        [sys.executable, "-m", STOP_HOLD_MODULE, sys.executable, "-c", LATE_CHILD],
        env={**_env(), "DDPKIT_SIGNAL": "USR2", "DDPKIT_LATCH_DIR": str(latched)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wrapper.stdin is not None and wrapper.stdout is not None
        first = wrapper.stdout.readline()
        assert first.startswith("child: starting"), first
        for pid in (wrapper.pid, int(first.split()[-1])):
            os.kill(pid, signal.SIGUSR2)
        wrapper.stdin.write("go\n")
        wrapper.stdin.flush()
        lines = [wrapper.stdout.readline(), wrapper.stdout.readline()]
        os.kill(wrapper.pid, signal.SIGTERM)  # the wrapper alone: it must wait for the command
        out, err = wrapper.communicate("exit\n", timeout=TIMEOUT_S)
        out = "".join(lines) + out
    finally:
        wrapper.kill()
        wrapper.wait()
    assert "child: SIGINT default_int_handler" in out, (out, err)  # as without the wrapper
    assert "child: received True" in out, (out, err)
    assert wrapper.returncode == 3, (wrapper.returncode, out, err)  # the command's own code
