"""On the real test cluster: a job that requeues itself (``requeue_and_exit`` in attempt 0)
runs twice, and both runs print one run id, ``slurm-<job id>``, with attempts 0 and 1; its job
record holds that run id and ``ddpkit status`` shows it with attempt 1 (SLURM's ``Restarts=``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "requeue_self.py"
LINE = re.compile(r"rank (\d) run (\S+) attempt (\d+)")
RUN = re.compile(r"run (\S+)(?: attempt (\d+))?")


def test_a_requeued_job_keeps_its_run_id_and_counts_attempts(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: runid\npartition: debug\nnodes: 2\nprocs_per_node: 1\nworkdir: {tmp_path}\n"
        f"log_dir: logs\nlaunch: srun\ntime_min: 5\ncommand: {SCRIPT}\n"
    )
    job = slurm.submit_spec(spec, home=tmp_path / "home")
    env = {**slurm.env, "DDPKIT_HOME": str(tmp_path / "home")}  # ddpkit status reads the record
    shown = watch_status(env, tmp_path, job)  # at whatever moments the polls land
    state = slurm.wait(job, timeout_s=240, states=FINISHED)
    logs = "\n".join(
        path.read_text(errors="replace") for path in sorted((tmp_path / "logs").glob("*"))
    )
    assert state == "COMPLETED", logs
    seen = sorted(set(LINE.findall(logs)))
    assert seen == [
        ("0", f"slurm-{job}", "0"), ("0", f"slurm-{job}", "1"),
        ("1", f"slurm-{job}", "0"), ("1", f"slurm-{job}", "1"),
    ], logs  # fmt: skip
    record = json.loads((tmp_path / "home" / "jobs" / f"{job}.json").read_text())
    assert record["run_id"] == f"slurm-{job}"
    status = subprocess.run(
        [sys.executable, "-m", "ddpkit", "status", job],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (status.returncode, status.stdout) == (
        0, f"COMPLETED (exit code 0)\nrun slurm-{job} attempt 1\n"
    ), status.stderr  # fmt: skip
    assert shown and set(shown) <= {
        (f"slurm-{job}", "0"),
        (f"slurm-{job}", "1"),
        (f"slurm-{job}", ""),
    }
    attempts = [int(attempt) for _, attempt in shown if attempt]
    assert attempts == sorted(attempts), shown  # the attempt never goes back


def watch_status(env: dict[str, str], workdir: Path, job: str) -> list[tuple[str, str]]:
    """``ddpkit status`` polled until the job has finished (bounded): every (run id, attempt)
    it showed on the way, the attempt "" where it showed none."""
    shown: list[tuple[str, str]] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        done = subprocess.run(
            [sys.executable, "-m", "ddpkit", "status", job],
            env=env, cwd=workdir, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        first, *rest = done.stdout.splitlines()
        for line in rest:
            match = RUN.fullmatch(line)
            assert match is not None, done.stdout
            shown.append((match[1], match[2] or ""))
        if first.split()[0] in FINISHED:
            return shown
        time.sleep(0.5)
    pytest.fail(f"job {job} still not finished after 240 s: {shown}")
