"""The CLI's exit codes say what kind of failure it was: 2 bad input only, 3 the rendezvous
failed, 4 the scheduler failed, 1 any other ddpkit error; each still one line
``ddpkit: error: ...`` without a traceback. The code lives on the error class
(``DdpkitError.exit_code``); scheduler and rendezvous failures used to exit 2 like a typo.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit import errors
from ddpkit.cli import main
from ddpkit.cluster.rendezvous.endpoint import RDZV_STEP
from ddpkit.cluster.rendezvous.ports import port_for_job


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.ConfigError, 2),
        (errors.NodelistError, 2),
        (errors.TopologyError, 2),
        (errors.RendezvousError, 3),
        (errors.SchedulerError, 4),
        (errors.CheckpointError, 1),
        (errors.UsageError, 1),
        (errors.DdpkitError, 1),
    ],
)
def test_each_error_class_carries_its_exit_code(error: type[errors.DdpkitError], code: int) -> None:
    assert error.exit_code == code
    assert f"{code}" in (errors.__doc__ or "")  # the table in the docstring shows it


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit: error: "), stderr
    assert "Traceback" not in stderr, stderr
    return lines[0]


def test_a_rendezvous_that_never_forms_exits_3(tmp_path: Path) -> None:
    # a non-host node of a SLURM step whose job-derived c10d port nobody hosts: `ddpkit run`
    # searches the candidates for 1 s and gives up before starting any worker
    job = "4242"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(SLURM_JOB_ID=job, SLURM_STEP_ID="0")
    endpoint = f"127.0.0.1:{port_for_job(job, RDZV_STEP)}"
    argv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", endpoint, "--rdzv-conf", "is_host=0,timeout=1"]
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", *argv, "-m", "json.tool", os.devnull],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    line = _one_error_line(done.stderr)
    assert done.returncode == 3, done.stderr
    assert "found no rendezvous store" in line


def test_status_without_slurms_tools_exits_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue anywhere: the scheduler is not there
    code = main(["status", "123"])
    _, err = capsys.readouterr()
    assert code == 4, err
    assert "'squeue' not found" in _one_error_line(err)
