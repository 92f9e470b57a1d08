"""``snapshot: true`` on the real SLURM cluster of ``ci/slurm-up`` (marker ``slurm``): a file
edited after ``ddpkit submit`` does not change what the job runs, in attempt 0 or, after a
requeue, in attempt 1.

The job is a torch-free stub (:data:`STUB`) in a git repository. It is submitted held
(``sbatch: {hold: true}``), so the first edit is sure to come before attempt 0 starts; attempt
0 waits for the test's second edit before it requeues its own job. Each attempt writes the
version it ran to a file outside the workdir. Without the snapshot, attempt 0 runs "v2" and
attempt 1 "v3".
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

GUARD_S = 90  # a hang guard, not a timing assertion

# VERSION is what the test edits; the rest stays. Attempt 0 waits for the test's "requeue"
# (bounded), then requeues its own job and waits to be ended by it.
STUB = """\
import os, pathlib, subprocess, sys, time
VERSION = "v1"
here = pathlib.Path(sys.argv[1])
attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
(here / f"ran-{attempt}").write_text(VERSION)
if attempt == 0:
    deadline = time.monotonic() + 60
    while not (here / "requeue").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
    time.sleep(60)
"""


def wait_for_file(path: Path) -> str:
    deadline = time.monotonic() + GUARD_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert path.exists(), f"{path.name} never written"
    return path.read_text()


def test_an_edit_after_submit_changes_neither_attempt(slurm: SlurmCluster, tmp_path: Path) -> None:
    work, control = tmp_path / "work", tmp_path / "control"
    work.mkdir()
    control.mkdir()
    stub = work / "job.py"
    stub.write_text(STUB)
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(["git", "-C", str(work), "add", "job.py"], check=True)
    spec = tmp_path / "snap.yaml"
    spec.write_text(
        f"name: snap\ncommand: job.py {control}\npython: {sys.executable}\nworkdir: {work}\n"
        "time_min: 5\nmax_requeues: 1\nsnapshot: true\nsbatch: {hold: true}\n"
    )
    job = slurm.submit_spec(spec, home=tmp_path / "home")
    stub.write_text(STUB.replace('"v1"', '"v2"'))  # after submit, before the job starts
    slurm.run("scontrol", "release", job)
    assert wait_for_file(control / "ran-0") == "v1"
    stub.write_text(STUB.replace('"v1"', '"v3"'))  # between attempt 0 and its requeue
    (control / "requeue").write_text("go")
    assert wait_for_file(control / "ran-1") == "v1"
    assert slurm.wait(job, GUARD_S) == "COMPLETED"
    (copy,) = (work / "ddpkit-logs" / "snapshots").iterdir()
    assert (copy / "job.py").read_text() == STUB
