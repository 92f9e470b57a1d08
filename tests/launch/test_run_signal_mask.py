"""Do no harm: outside a ddpkit job, ``ddpkit run``'s workers get the stop signal as under torchrun.

The launcher holds SIGUSR2 from its first line (never dies of it, keeps one that comes before
the workers can take it: tests/launch/test_run_signals.py), but outside a ddpkit job (no
``DDPKIT_SIGNAL`` in its environment) its workers start with the signal mask the user started
it with: SIGUSR2 not blocked, in each worker and in what it starts, so a script's own handler
runs when the signal is sent to it. A SIGUSR2 sent to the launcher goes to a worker only once it
catches the signal: a worker that handles it late gets it then, one that never handles it is
never killed by it. In a ddpkit job, and when the user started the launcher with SIGUSR2
blocked, the workers start with it blocked, as before.

Real ``ddpkit run --nproc-per-node 2`` runs of ``tests/scripts/mask_worker.py``, a script that
does not import ddpkit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.pids import signal_if_same, start_ticks

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "scripts" / "mask_worker.py")
TIMEOUT_S = 120.0
# the launcher started with SIGUSR2 blocked, as a parent that blocks it would start it
BLOCKED_START = (
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2]); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _env(**extra: str) -> dict[str, str]:
    drop = ("SLURM_", "DDPKIT_", "PET_", "TORCHELASTIC_")
    kept = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**kept, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **extra}


def _start(
    where: Path, modes: str, seconds: float, env: dict[str, str], *, blocked: bool = False
) -> subprocess.Popen[bytes]:
    prefix = [sys.executable, "-c", BLOCKED_START] if blocked else [sys.executable]
    command = [*prefix, "-m", "ddpkit", "run", "--nproc-per-node", "2", WORKER]
    with (where / "out").open("w") as out, (where / "err").open("w") as err:
        return subprocess.Popen(
            [*command, str(where), modes, str(seconds)],
            cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip


def _wait_for(run: subprocess.Popen[bytes], *files: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not all(file.exists() for file in files):
        assert run.poll() is None, f"the run ended first (exit {run.returncode})"
        assert time.monotonic() < deadline, f"no {files}"
        time.sleep(0.005)


def _end(run: subprocess.Popen[bytes], where: Path) -> tuple[int, str, str]:
    try:
        code = run.wait(timeout=TIMEOUT_S)
    finally:
        if run.poll() is None:
            run.kill()
        run.wait()
    return code, (where / "out").read_text(), (where / "err").read_text()


def _masks(stdout: str) -> dict[str, str]:
    """Rank -> "<SIGUSR2 blocked in the worker> <blocked in its child>", from the workers."""
    found = {}
    for line in stdout.splitlines():
        words = line.split()
        if "mask" in words:
            rank, worker, child = words[words.index("mask") + 1 :][:3]
            found[rank] = f"{worker} {child}"
    return found


def test_outside_a_job_a_workers_own_handler_runs_on_a_signal_sent_to_it(tmp_path: Path) -> None:
    """As under torchrun: not blocked in the worker nor in its child, and ``kill -USR2
    <worker>`` runs the script's handler."""
    run = _start(tmp_path, "own,own", 20.0, _env())
    try:
        ready = [tmp_path / f"ready.{rank}" for rank in (0, 1)]
        _wait_for(run, *ready)
        for file in ready:
            pid = int(file.read_text())
            assert signal_if_same(pid, start_ticks(pid), signal.SIGUSR2), f"{pid} is gone"
    finally:
        code, stdout, stderr = _end(run, tmp_path)
    where = f"exit {code}\n{stdout}\n{stderr}"
    assert _masks(stdout) == {"0": "False False", "1": "False False"}, where
    assert "got 0" in stdout and "got 1" in stdout, where
    assert code == 0, where


@pytest.mark.parametrize("torch_handles", ["", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"])
def test_a_signal_to_the_launcher_waits_until_a_worker_catches_it_and_kills_none(
    tmp_path: Path, torch_handles: str
) -> None:
    """Rank 0 installs its handler 1 s after it starts, rank 1 never does. A SIGUSR2 to the
    launcher once both run (before rank 0's handler), then a storm of them to its end: rank 0's
    handler gets one once it is in place, rank 1 is never killed, the run ends 0. Also when
    torch is asked to handle SIGUSR2 (``PET_SIGNALS_TO_HANDLE``): the relay passes it on,
    torch's agent does not shut the workers down."""
    extra = {"PET_SIGNALS_TO_HANDLE": torch_handles} if torch_handles else {}
    run = _start(tmp_path, "late,never", 4.0, _env(**extra))
    sent = 0
    try:
        _wait_for(run, tmp_path / "start.0", tmp_path / "start.1")
        assert not (tmp_path / "ready.0").exists(), "rank 0 caught it first: no test"
        while run.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(run.pid, signal.SIGUSR2)
                sent += 1
            time.sleep(0.03)
    finally:
        code, stdout, stderr = _end(run, tmp_path)
    where = f"exit {code}, {sent} sent\n{stdout}\n{stderr}"
    assert _masks(stdout) == {"0": "False False", "1": "False False"}, where
    assert "got 0" in stdout and "finished 1" in stdout, where
    assert code == 0 and "worker failed" not in stderr, where


@pytest.mark.parametrize("how", ["in-a-job", "started-blocked"])
def test_in_a_job_or_started_blocked_the_workers_start_with_it_blocked(
    tmp_path: Path, how: str
) -> None:
    """In a ddpkit job (``DDPKIT_SIGNAL`` set) SLURM signals the workers before they latch it:
    blocked, it stays pending until then. A launcher started with it blocked passes that on."""
    env = _env(DDPKIT_SIGNAL="SIGUSR2") if how == "in-a-job" else _env()
    run = _start(tmp_path, "never,never", 0.2, env, blocked=how == "started-blocked")
    code, stdout, stderr = _end(run, tmp_path)
    where = f"exit {code}\n{stdout}\n{stderr}"
    assert _masks(stdout) == {"0": "True True", "1": "True True"}, where
    assert code == 0, where
