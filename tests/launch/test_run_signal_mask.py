"""Do no harm: outside a ddpkit job, ``ddpkit run``'s workers get the stop signal as under torchrun.

The launcher holds SIGUSR2 from its first line (never dies of it, keeps one that comes before
the workers can take it: tests/launch/test_run_signals.py), but outside a ddpkit job (no
``DDPKIT_SIGNAL`` in its environment) its workers start with the signal mask the user started
it with: SIGUSR2 not blocked, in each worker and in what it starts, so a script's own handler
runs when the signal is sent to it. A SIGUSR2 sent to the launcher goes to a worker only once it
catches the signal: a worker that handles it late gets it then, one that never handles it is
never killed by it. In a ddpkit job, and when the user started the launcher with SIGUSR2
blocked, the workers start with it blocked, as before.

Real ``ddpkit run`` runs of ``tests/scripts/mask_worker.py``, a script that does not import
ddpkit: each launch costs the launcher's torch import, so one launch shows both what a signal
sent to a worker does and what one sent to the launcher does (a rank more is a plain Python).
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
    nproc = str(len(modes.split(",")))
    command = [*prefix, "-m", "ddpkit", "run", "--nproc-per-node", nproc, WORKER]
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


def _wait_for_line(run: subprocess.Popen[bytes], where: Path, line: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while line not in (where / "out").read_text():
        assert run.poll() is None, f"the run ended first (exit {run.returncode})"
        assert time.monotonic() < deadline, f"no {line!r}"
        time.sleep(0.005)


@pytest.mark.parametrize("torch_handles", ["", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"])
def test_outside_a_job_a_signal_to_a_worker_runs_its_handler_one_to_the_launcher_waits_for_it(
    tmp_path: Path, torch_handles: str
) -> None:
    """As under torchrun: SIGUSR2 blocked in no worker nor in its child, and ``kill -USR2
    <worker>`` runs the script's handler (rank 2, which installs it at once: signalled before
    anything is sent to the launcher). Then a signal to the launcher waits until a worker
    catches it and kills none: rank 0 installs its handler only once the test, having sent
    the launcher a SIGUSR2, says so (``go``); rank 1 never does. A storm of them to the
    launcher's end: rank 0's handler gets one once it is in place, rank 1 is never killed, the
    run ends 0. Also when torch is asked to handle SIGUSR2 (``PET_SIGNALS_TO_HANDLE``): the
    relay passes it on, torch's agent does not shut the workers down."""
    extra = {"PET_SIGNALS_TO_HANDLE": torch_handles} if torch_handles else {}
    run = _start(tmp_path, "late,never,own", 4.0, _env(**extra))
    sent = 0
    try:
        _wait_for(run, tmp_path / "start.0", tmp_path / "start.1", tmp_path / "ready.2")
        pid = int((tmp_path / "ready.2").read_text())
        assert signal_if_same(pid, start_ticks(pid), signal.SIGUSR2), f"{pid} is gone"
        _wait_for_line(run, tmp_path, "got 2")  # the handler ran, and rank 2 is done
        assert not (tmp_path / "ready.0").exists(), "rank 0 caught it before the go"
        while run.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(run.pid, signal.SIGUSR2)
                sent += 1
            (tmp_path / "go").touch()  # after the first signal to the launcher
            time.sleep(0.03)
    finally:
        code, stdout, stderr = _end(run, tmp_path)
    where = f"exit {code}, {sent} sent\n{stdout}\n{stderr}"
    assert _masks(stdout) == {r: "False False" for r in ("0", "1", "2")}, where
    assert "got 0" in stdout and "finished 1" in stdout and "got 2" in stdout, where
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
