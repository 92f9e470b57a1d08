"""RunCommand (the submitit backend's command runner) passes the stop signal on to its child.

RunCommand runs in a subprocess, as it would in a submitit task, with a small Python child
that waits for the stop signal. The signal goes to the RunCommand process only: the child must
get it, and RunCommand must end the way submitit expects (SystemExit(0) after a signal and a
clean exit of the child, CalledProcessError for a nonzero exit, a plain return otherwise).
A child signalled before it has latched the signal (SLURM signals every process of the step)
must not die of it, and must find it once it latches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.support.pids import signal_if_same, start_ticks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30.0

# The submitit task's side: RunCommand(argv[1:])(), reporting how it ended.
RUNNER = """
import sys
from ddpkit.launch.submitit_task import RunCommand
try:
    code = RunCommand(sys.argv[1:])()
except SystemExit as exc:
    print(f"runner: SystemExit({exc.code}) submitit={'submitit' in sys.modules}", flush=True)
    raise
print(f"runner: returned {code} submitit={'submitit' in sys.modules}", flush=True)
"""

# The command: waits for SIG<argv[1]> (at most 10 s), then exits with argv[2]. It handles the
# signal itself, so it unblocks it as ddpkit.init() would (RunCommand starts it blocked).
CHILD = """
import os, signal, sys, time
got = []
sig = getattr(signal, "SIG" + sys.argv[1])
signal.signal(sig, lambda signum, frame: got.append(signum))
signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
print(f"child: ready {os.getpid()}", flush=True)
deadline = time.monotonic() + 10
while not got and time.monotonic() < deadline:
    time.sleep(0.005)
print("child: got it" if got else "child: never got it", flush=True)
sys.exit(int(sys.argv[2]) if got else 9)
"""


def _env(**extra: str) -> dict[str, str]:
    kept = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPKIT_", "SUBMITIT_"))
    }
    return {**kept, "PYTHONPATH": str(ROOT / "src"), **extra}


def _signalled_run(
    send: signal.Signals, wait_for: str, child_code: int = 0, **env: str
) -> tuple[int, str, str]:
    """Start RunCommand with the waiting child, send ``send`` to RunCommand once the child is
    ready; RunCommand's exit code, stdout (its own and the child's) and stderr (plus a note if
    the child outlived RunCommand)."""
    command = [sys.executable, "-c", CHILD, wait_for, str(child_code)]
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, *command],
        cwd=ROOT,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(TIMEOUT_S, runner.kill)  # nothing here may hang the suite
    timer.start()
    try:
        assert runner.stdout is not None
        head = []
        for line in runner.stdout:
            head.append(line)
            if line.startswith("child: ready"):
                break
        assert head and head[-1].startswith("child: ready"), "".join(head)
        child_pid = int(head[-1].split()[-1])
        child_started = start_ticks(child_pid)  # it runs now; its pid may name another later
        runner.send_signal(send)  # RunCommand only, never the child directly
        rest, err = runner.communicate(timeout=TIMEOUT_S)
    finally:
        timer.cancel()
        runner.kill()
        runner.wait()
    out = "".join(head) + rest
    if signal_if_same(child_pid, child_started):  # an orphan, if RunCommand died before it
        err += f"\ntest: the child {child_pid} outlived RunCommand"
    return runner.returncode, out, err


def test_stop_signal_is_passed_on_and_a_clean_child_exit_is_systemexit_0() -> None:
    code, out, err = _signalled_run(signal.SIGUSR2, "USR2")
    assert "child: got it" in out, (out, err)
    assert "ddpkit: stopped after the stop signal" in out, (out, err)
    assert "runner: SystemExit(0) submitit=False" in out, (out, err)
    assert code == 0, (out, err)
    assert "outlived" not in err, err


def test_ddpkit_signal_usr1_selects_usr1() -> None:
    code, out, err = _signalled_run(signal.SIGUSR1, "USR1", DDPKIT_SIGNAL="USR1")
    assert "child: got it" in out, (out, err)
    assert "runner: SystemExit(0)" in out, (out, err)
    assert code == 0, (code, out, err)
    assert "outlived" not in err, err


def test_nonzero_exit_after_the_signal_is_still_a_called_process_error() -> None:
    code, out, err = _signalled_run(signal.SIGUSR2, "USR2", child_code=75)
    assert "child: got it" in out, (out, err)
    assert code == 1, (code, out, err)  # an uncaught exception in the runner
    assert "CalledProcessError" in err and "non-zero exit status 75" in err, err
    assert "stopped after the stop signal" not in out


def _plain_run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUNNER, sys.executable, "-c", script],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def test_child_exiting_3_raises_called_process_error() -> None:
    done = _plain_run("import sys; print('child: failing', flush=True); sys.exit(3)")
    assert "child: failing" in done.stdout, done
    assert done.returncode == 1, done
    assert "subprocess.CalledProcessError" in done.stderr, done.stderr
    assert "returned non-zero exit status 3" in done.stderr, done.stderr
    assert "runner: returned" not in done.stdout and "SystemExit" not in done.stdout


def test_child_exiting_0_without_a_signal_returns_0() -> None:
    done = _plain_run("print('child: done', flush=True)")
    assert done.returncode == 0, done
    assert "ddpkit: running" in done.stdout and "child: done" in done.stdout, done.stdout
    assert "runner: returned 0 submitit=False" in done.stdout, done.stdout
    assert "stopped after the stop signal" not in done.stdout


# A ddpkit child whose start (Python, torch) is still under way when the signal comes: it says
# so, waits for a line on stdin (the test sends it once the signal is out), then latches.
LATE_CHILD = """
import os, signal, sys
print(f"child: starting {os.getpid()}", flush=True)
sys.stdin.readline()
pending = signal.SIGUSR2 in signal.sigpending()
from ddpkit.cluster.stop import latch as stopsignal
stopsignal.latch(signal.SIGUSR2)
print(f"child: pending before the latch {pending}, received {stopsignal.received(signal.SIGUSR2)}",
      flush=True)
"""


def test_a_child_signalled_before_it_latched_neither_dies_nor_loses_the_signal() -> None:
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, sys.executable, "-c", LATE_CHILD],
        cwd=ROOT,
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(TIMEOUT_S, runner.kill)
    timer.start()
    try:
        assert runner.stdin is not None and runner.stdout is not None
        head = []
        for line in runner.stdout:
            head.append(line)
            if line.startswith("child: starting"):
                break
        assert head and head[-1].startswith("child: starting"), "".join(head)
        child_pid = int(head[-1].split()[-1])
        os.kill(child_pid, signal.SIGUSR2)  # as SLURM does, to every process of the step
        runner.send_signal(signal.SIGUSR2)  # and RunCommand passes it on at once
        out, err = runner.communicate("go\n", timeout=TIMEOUT_S)
    finally:
        timer.cancel()
        runner.kill()
        runner.wait()
    assert "child: pending before the latch True, received True" in out, (out, err)
    assert "runner: SystemExit(0)" in out, (out, err)
    assert runner.returncode == 0, (out, err)


def test_a_runner_pickled_at_its_old_path_still_loads() -> None:
    """Jobs submitted before the move pickled ``ddpkit.jobs.submitit_backend.RunCommand``: a
    requeued one unpickles it from there (the one shim), and gets the runner of launch/."""
    import pickle

    from ddpkit.jobs.backends import submitit as submitit_backend
    from ddpkit.launch.submitit_task import RunCommand

    old = pickle.dumps(RunCommand(["true"], cwd="/tmp"), protocol=0).replace(  # text: editable
        b"ddpkit.launch.submitit_task", b"ddpkit.jobs.submitit_backend"
    )
    assert b"ddpkit.jobs.submitit_backend" in old
    loaded = pickle.loads(old)
    assert type(loaded) is RunCommand and loaded.command == ["true"]
    assert submitit_backend.run_command(["x"], cwd="/").__class__ is RunCommand
