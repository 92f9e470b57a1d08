"""SIGUSR1/SIGUSR2 never kill ``ddpkit run``, from its first line to its exit (no DDPKIT_SIGNAL).

A real ``ddpkit run --nproc-per-node 2`` of ``tests/scripts/stop_worker.py`` (which latches
SIGUSR2 late, as a guard does, and stops with 75 once it came) gets a storm of one signal,
every 10 to 50 ms (random, seeded), from a given moment until it has exited. The first moment
is the first instant the launcher holds the signal (read from ``/proc/<pid>/status``; that this
comes before any heavy import is checked on its own, without timing), and that storm goes on
over its whole start (the torch import); the others start in the workers' run and in its
teardown, which every storm reaches.

The launcher never dies of the signal (its exit status is never negative), and with SIGUSR2 the
outcome is the documented one: 75 when the workers saw the stop signal (they say ``stopped``),
0 when they finished first; one that came before any worker existed is kept for the workers,
which stop with 75. SIGUSR1 is passed on to the workers too, which ignore it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.cluster.stop.signals import ALLOWED_SIGNALS, parse_signal, stop_signal

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "scripts" / "stop_worker.py")
TRAIN_S = "1.5"
TIMEOUT_S = 120.0


def _env() -> dict[str, str]:
    drop = ("SLURM_", "DDPKIT_", "PET_", "TORCHELASTIC_")
    kept = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**kept, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def _holds(pid: int, sig: signal.Signals) -> bool:
    """Does ``pid`` block, ignore or catch ``sig`` (so that it cannot die of it)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.partition(":")[::2] for line in status.splitlines())
    bit = 1 << (int(sig) - 1)
    return any(int(fields[name], 16) & bit for name in ("SigBlk", "SigIgn", "SigCgt"))


# (signal, from when: seconds after the launcher holds it or "teardown" (a worker finished), seed
# of the intervals). A run takes 2 to 4 s here: launcher start ~1 s, workers 1.8 s, teardown.
# A storm lasts until the exit, so it also reaches every later phase: the one from the first
# instant hits the launcher's whole start (torch's import) too, and the next one starts once
# the workers run. Each is a real launch of 3 interpreters (~3 CPU-s, most of it the
# launcher's torch import), so a phase is not sampled twice.
STORMS: list[tuple[signal.Signals, float | str, int]] = [
    (signal.SIGUSR2, 0.0, 1),  # from the first instant: before any import of the launcher's
    (signal.SIGUSR2, 2.0, 6),  # while the workers run
    (signal.SIGUSR2, "teardown", 7),  # after the workers' last look at the latch
    (signal.SIGUSR1, 0.0, 9),
]


@pytest.mark.parametrize(
    ("sig", "offset", "seed"), STORMS, ids=[f"{s.name}-{o}-{n}" for s, o, n in STORMS]
)
def test_a_signal_storm_never_kills_the_launcher(
    tmp_path: Path, sig: signal.Signals, offset: float | str, seed: int
) -> None:
    rng = random.Random(seed)
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", WORKER]
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        run = subprocess.Popen(
            [*command, str(tmp_path), TRAIN_S],
            cwd=ROOT, env=_env(), stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    before_workers: bool | None = None
    sent = 0
    try:
        while not _holds(run.pid, sig) and run.poll() is None:
            assert time.monotonic() < deadline, "the launcher never held the signal"
            time.sleep(0.001)
        storm_at = time.monotonic() + (offset if isinstance(offset, float) else TIMEOUT_S)
        while run.poll() is None:
            assert time.monotonic() < deadline, "the run did not end"
            if offset == "teardown" and "finished" in (tmp_path / "out").read_text():
                storm_at = time.monotonic()
            if time.monotonic() >= storm_at:
                if before_workers is None:
                    before_workers = not list(tmp_path.glob("start.*"))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(run.pid, sig)
                    sent += 1
            time.sleep(rng.uniform(0.01, 0.05))
    finally:
        if run.poll() is None:
            run.kill()
        run.wait()
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    where = f"{sig.name} from {offset}: exit {run.returncode}, {sent} sent\n{stdout}\n{stderr}"
    assert run.returncode >= 0, f"the launcher died of a signal: {where}"
    assert "Traceback" not in stdout + stderr, where  # neither the launcher's nor a worker's
    assert sent > 0, where
    if sig == signal.SIGUSR1:  # passed on; the workers ignore it (unless it came before that)
        assert run.returncode == 0 or "signal SIGUSR1" in stderr, where
        return
    stopped = "stopped" in stdout
    assert run.returncode == (75 if stopped else 0), where
    assert "worker failed" not in stderr, where
    if before_workers:  # kept until the workers existed, then theirs
        assert run.returncode == 75, where
    if offset == "teardown":  # after the last check of the latch: the workers finished
        assert run.returncode == 0, where


def test_one_stop_signal_before_the_workers_exist_is_kept_for_them(tmp_path: Path) -> None:
    """A single SIGUSR2 while the launcher starts (0.3 s after it holds the signal: importing
    torch, no worker yet, nor any other child for it to go astray to): kept, then sent to the
    workers once they exist, which stop with 75. (The signal is held from the first instant
    the same way: one launch, not one for each moment of that window.)"""
    offset = 0.3
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", WORKER]
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        run = subprocess.Popen(
            [*command, str(tmp_path), TRAIN_S],
            cwd=ROOT, env=_env(), stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not _holds(run.pid, signal.SIGUSR2):
            assert run.poll() is None and time.monotonic() < deadline, "never held"
            time.sleep(0.001)
        time.sleep(offset)
        assert not list(tmp_path.glob("start.*")), "the workers started first: no test"
        os.kill(run.pid, signal.SIGUSR2)
        code = run.wait(timeout=TIMEOUT_S)
    finally:
        if run.poll() is None:
            run.kill()
        run.wait()
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert code == 75 and stdout.count("stopped") == 2, f"exit {code}\n{stdout}\n{stderr}"
    assert "stopped early with a checkpoint" in stderr, stderr


@pytest.mark.parametrize(
    "text", [*ALLOWED_SIGNALS, "usr1", " SIGTERM ", "sigHUP", "10", "12", "15"]
)
def test_the_early_reading_of_ddpkit_signal_agrees_with_the_checked_one(text: str) -> None:
    """``relay.hold`` reads DDPKIT_SIGNAL leniently before anything is imported; the launcher
    checks it later with ``parse_signal``: both must name the same signal, or the held one
    would be lost (one reader now: ``ddpkit.cluster.stop.signals``)."""
    assert stop_signal({"DDPKIT_SIGNAL": text}, lenient=True) == parse_signal(text)


@pytest.mark.parametrize("text", ["", "KILL", "9", "bogus", "USR²", "１２"])
def test_an_unusable_ddpkit_signal_is_held_as_sigusr2_until_the_launcher_rejects_it(
    text: str,
) -> None:
    assert stop_signal({"DDPKIT_SIGNAL": text}, lenient=True) == signal.SIGUSR2


@pytest.mark.parametrize("argv", [[], ["submit", "job.yaml"], ["--version"], ["plan", "run"]])
def test_only_ddpkit_run_holds_signals(argv: list[str]) -> None:
    from ddpkit.launch import relay

    before = {sig: signal.getsignal(sig) for sig in relay.FORWARDED}
    assert relay.hold(argv, {}) is None
    assert {sig: signal.getsignal(sig) for sig in relay.FORWARDED} == before
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & set(relay.FORWARDED)


# The ``ddpkit`` entry point with relay.hold spied on: what had been imported when it ran.
SPY = """
import os, signal, sys
import ddpkit.__main__ as entry
real = entry.relay.hold
def spy(argv, env):
    held = real(argv, env)
    blocked = signal.SIGUSR2 in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    heavy = sorted(m for m in ("torch", "ddpkit.cli", "ddpkit.launch.local") if m in sys.modules)
    print(held == signal.SIGUSR2, blocked, heavy, flush=True)
    os._exit(0)
entry.relay.hold = spy
sys.argv = ["ddpkit", "run", "--nproc-per-node", "2", "train.py"]
entry.main()
"""


def test_the_entry_point_holds_the_signal_before_anything_heavy_is_imported() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SPY], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    # held: SIGUSR2; blocked in the main thread; none of the command line, the launcher, torch
    assert done.stdout == "True True []\n", (done.stdout, done.stderr)
