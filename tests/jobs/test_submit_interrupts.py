"""A stop signal while ``ddpkit submit`` hands a job to sbatch: never a job without its record.

``ddpkit submit`` runs in a subprocess in a session of its own, as a terminal's foreground job:
the signal goes to its whole process group, as Ctrl-C does. Its ``sbatch`` is a fake that takes
1 s (a real one takes milliseconds: the window no outside timing hits on demand); the real
cluster's submissions are tests/jobs/test_jobs_cluster.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.jobs import api
from ddpkit.jobs.records import load_record
from tests.fakes.slurm import FakeTools

JOB_ID = "4242"
# started, then 1 s before it answers, as a loaded controller might; done after it answered
_SLOW_SBATCH = """#!/bin/sh
cat > "{calls}/sbatch.stdin"
touch "{calls}/sbatch.started"
sleep 1
echo {job_id}
touch "{calls}/sbatch.done"
"""


# submitit's: the script as an argument, the id in sbatch's sentence
_SLOW_SBATCH_FOR_SUBMITIT = """#!/bin/sh
cp "$1" "{calls}/sbatch.stdin"
touch "{calls}/sbatch.started"
sleep 1
echo Submitted batch job {job_id}
touch "{calls}/sbatch.done"
"""


def _submit(tmp_path: Path, via: str = "sbatch") -> tuple[subprocess.Popen[str], Path]:
    tools = FakeTools(tmp_path / "bin", tmp_path / "calls")
    slow = _SLOW_SBATCH_FOR_SUBMITIT if via == "submitit" else _SLOW_SBATCH
    tools.install("sbatch", slow.format(calls=tools.calls, job_id=JOB_ID))
    tools.scontrol_jobs()
    tools.srun()  # submitit's executor needs one on PATH
    spec = tmp_path / "job.yaml"
    spec.write_text("name: demo\ncommand: train.py\nnodes: 1\nprocs_per_node: 1\n")
    env = {**os.environ, "PATH": tools.path(), "DDPKIT_HOME": str(tmp_path / "home")}
    submit = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "submit", str(spec), "--via", via],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a terminal's foreground job
    )
    return submit, tools.calls


def _records(tmp_path: Path) -> list[str]:
    jobs = tmp_path / "home" / "jobs"
    return sorted(json.loads(path.read_text())["job_id"] for path in jobs.glob("*.json"))


@pytest.mark.parametrize("via", ["sbatch", "submitit"])
@pytest.mark.parametrize("delay_s", [0.0, 0.5])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_while_sbatch_runs_waits_for_the_record_and_the_id(
    tmp_path: Path, signum: int, delay_s: float, via: str
) -> None:
    """Before the hold, Ctrl-C reached sbatch too (one process group) and cut ddpkit short
    while the job could be queued: no record, no id printed. Through submitit, sbatch is
    submitit's child: it heard the signal until it ran in a session of its own."""
    submit, calls = _submit(tmp_path, via)
    try:
        deadline = time.monotonic() + 60
        while not (calls / "sbatch.started").exists():
            assert submit.poll() is None, submit.communicate()
            assert time.monotonic() < deadline, "sbatch was never called"
            time.sleep(0.01)
        time.sleep(delay_s)
        os.killpg(submit.pid, signum)
        out, err = submit.communicate(timeout=60)
    finally:
        if submit.poll() is None:
            os.killpg(submit.pid, signal.SIGKILL)
            submit.communicate()
    assert (calls / "sbatch.done").exists(), "sbatch was cut short"
    assert out == f"{JOB_ID}\n", (out, err)
    assert _records(tmp_path) == [JOB_ID]
    assert "Traceback" not in err, err
    if signum == signal.SIGINT:
        assert (submit.returncode, err.splitlines()[-1:]) == (130, ["ddpkit: interrupted"]), err
    else:  # SIGTERM: as it would have, once the job is recorded and its id printed
        assert submit.returncode == -signal.SIGTERM, err


@pytest.mark.parametrize("delay_s", [0.02, 0.2, 0.4, 0.6, 0.8, 1.0, 1.3, 1.6, 2.0])
def test_a_ctrl_c_at_any_moment_never_leaves_a_job_without_its_record(
    tmp_path: Path, delay_s: float
) -> None:
    """From the start of the command (its imports, the dry run, sbatch, the record, the id):
    sbatch was given the job exactly when the job is recorded and its id printed."""
    submit, calls = _submit(tmp_path)
    time.sleep(delay_s)
    try:
        os.killpg(submit.pid, signal.SIGINT)
        out, err = submit.communicate(timeout=60)
    finally:
        if submit.poll() is None:
            os.killpg(submit.pid, signal.SIGKILL)
            submit.communicate()
    given = (calls / "sbatch.stdin").exists()
    assert given == (calls / "sbatch.done").exists(), "sbatch was cut short"
    assert (_records(tmp_path), out) == (([JOB_ID], f"{JOB_ID}\n") if given else ([], "")), err
    if submit.returncode == 1 and not given:
        # Ctrl-C while Python itself starts, before any of ddpkit runs (a loaded CI machine can
        # make those moments long): a fatal error while it sets up sys.stderr and the like or
        # imports its site module, or, once those are done, "Could not import runpy module"
        # (what `python -m` imports next; a clean-clone run, 2026-12-03). All three seen with
        # `python -m json.tool` interrupted in its first ~20 ms.
        started = ("Fatal Python error: init_", "Could not import runpy module")
        assert err.startswith(started) and "KeyboardInterrupt" in err, err
    else:
        assert submit.returncode in (0, 130, -signal.SIGINT), err


# An sbatch during which the submitting process gets Ctrl-C (its parent: the test's process),
# answering as submitit reads it, or as ddpkit's --parsable sbatch does
_SBATCH_INTERRUPTED = """#!/bin/sh
kill -INT $PPID
cat > /dev/null
case "$*" in *--parsable*) echo 77 ;; *) echo Submitted batch job 77 ;; esac
"""


@pytest.mark.parametrize(
    "how", ["submit", "submit via submitit", "submit_function", "map_function"]
)
def test_a_ctrl_c_during_an_api_submission_comes_after_the_job_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The Python API holds the signal as the command line does: the program gets its
    KeyboardInterrupt once the job SLURM accepted has its record (``ddpkit status 77``)."""
    tools = FakeTools(tmp_path / "bin")
    tools.install("sbatch", _SBATCH_INTERRUPTED)
    tools.srun()  # submitit renders its script only where srun is
    monkeypatch.setenv("PATH", tools.path())
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    sweep = "sweep: {params: {lr: ['0.1', '0.2']}}\n" if how == "map_function" else ""
    path = tmp_path / "job.yaml"
    path.write_text(f"name: demo\ncommand: train.py\nnodes: 1\nprocs_per_node: 1\n{sweep}")
    spec = api.load(path)
    with pytest.raises(KeyboardInterrupt):
        if how == "submit":
            api.submit(spec)
        elif how == "submit via submitit":
            api.submit(spec, "submitit")
        elif how == "submit_function":
            api.submit_function(print, "hello", spec=spec)
        else:
            api.map_function(dict, spec=spec)
        pytest.fail("the held Ctrl-C never came")
    record = load_record("77")
    assert record is not None, "a job SLURM accepted has no record"
    assert record.job_id == "77"
