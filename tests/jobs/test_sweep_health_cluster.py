"""A sweep with a ``health_check`` on the real test cluster: one task's node fails the check in
its first attempt; that task alone is requeued with the node excluded and completes, the other
tasks run once, and ``ddpkit status ARRAY`` shows each task's own run id and attempt.

One array of three 1-node tasks (``x=a``, ``x=b``, ``x=c``), confined to n1..n3 (``sbatch:
{exclude: n4}``, which must stay in every task's ``ExcNodeList``). The check fails for task 1
only, on the node it names in ``./bad`` in its first attempt (a node bad for one task keeps the
other tasks' outcome certain however SLURM places them). While the sweep runs, ``ddpkit status
ARRAY`` is polled (at whatever moments the polls land): every task always shows its own run id
and its attempt never goes back. Then: task 1 ran twice (sacct: REQUEUED, COMPLETED), the second
time on another node, with ``ExcNodeList`` = n4 + the bad node and the exclusion line in its
log; its command ran only in attempt 1, seeing ``slurm-<array>_1`` attempt 1; tasks 0 and 2 ran
once, attempt 0, nothing excluded; the table shows attempts 0, 1, 0.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.cluster.nodelist import expand_nodelist
from tests.jobs.test_health_check_cluster import accounted
from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = pytest.mark.slurm

NODES = ["n1", "n2", "n3"]
RUNS = ["x=a", "x=b", "x=c"]
TIMEOUT_S = 150
APP = """import os, sys
from ddpkit.cluster.runid import run_identity
run = run_identity(os.environ)
print(f"value {sys.argv[1]} run {run.run_id} attempt {run.attempt} on",
      os.environ["SLURMD_NODENAME"], flush=True)
"""
TASK_ONE_BAD = """#!/bin/bash
# task 1's first node is bad for task 1: attempt 0 names it in ./bad; a node named there fails
cd -- "$(dirname -- "$0")"
[ "$SLURM_ARRAY_TASK_ID" = 1 ] || exit 0
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
  echo "$SLURMD_NODENAME" > "bad.$SLURMD_NODENAME" && mv "bad.$SLURMD_NODENAME" bad
fi
if [ "$SLURMD_NODENAME" = "$(cat bad 2>/dev/null)" ]; then
  echo "node $SLURMD_NODENAME is marked bad by the test"; exit 1
fi
"""
# one row of the table: task, state (with how it ended), attempt, run id, run name
ROW = re.compile(r"(\d+_\d+)\s+([A-Z_]+)(?: \([^)]*\))?\s+(\d+|-)\s+(\S+)\s+(\S+)")


def test_a_task_whose_node_fails_its_check_is_requeued_alone_and_keeps_its_run_id(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    if not slurm.accounting:
        pytest.fail("this test reads the tasks' runs from sacct: start ci/slurm-up with accounting")
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "check.sh").write_text(TASK_ONE_BAD)
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: hcsweep\npartition: debug\nnodes: 1\nprocs_per_node: 1\ncpus_per_task: 1\n"
        f"time_min: 3\nworkdir: {tmp_path}\nlog_dir: logs\npython: {sys.executable}\n"
        f"command: app.py {{x}}\nsbatch: {{exclude: n4}}\nhealth_check_timeout_s: 20\n"
        f"health_check: bash {tmp_path / 'check.sh'}\nsweep: {{params: {{x: [a, b, c]}}}}\n"
    )
    job = slurm.submit_spec(spec, home=tmp_path / "home")
    env = {**slurm.env, "DDPKIT_HOME": str(tmp_path / "home")}  # ddpkit status reads the record
    shown = watch_table(env, tmp_path, job)
    for task in range(3):  # settled in sacct too
        slurm.wait(f"{job}_{task}", timeout_s=60, states=FINISHED)
    logs = tmp_path / "logs"
    batch = [(logs / f"hcsweep-{job}_{t}.out").read_text(errors="replace") for t in range(3)]
    app = ["".join(p.read_text() for p in (logs / run).glob("*.out")) for run in RUNS]
    runs = [accounted(slurm, f"{job}_{task}") for task in range(3)]
    where = f"array {job}: runs {runs}\n" + "\n".join(batch)

    # the polls: each task's own run id always, its attempt never back, tasks 0 and 2 at 0
    for task in range(3):
        seen = [attempt for t, attempt, _ in shown if t == task]
        assert {run_id for t, _, run_id in shown if t == task} == {f"slurm-{job}_{task}"}, shown
        numbers = [int(a) for a in seen if a != "-"]
        assert numbers == sorted(numbers) and set(numbers) <= {0, 1}, shown
        if task != 1:
            assert set(numbers) <= {0}, shown

    # task 1: requeued away from its bad node, then completed elsewhere
    bad = (tmp_path / "bad").read_text().strip()
    assert bad in NODES, where
    assert [run[0] for run in runs[1]] == ["REQUEUED", "COMPLETED"], where
    first, second = (run[2] for run in runs[1])
    assert first == bad and second in NODES and second != bad, where
    assert sorted(expand_nodelist(excluded(slurm, f"{job}_1"))) == sorted(["n4", bad]), where
    assert (
        f"ddpkit: excluding node {bad} (health check failed: exit code 1: node {bad} is marked "
        f"bad by the test); requeue attempt 1, excluded: {bad} (1 of max 2)"
    ) in batch[1], where
    assert app[1] == f"value b run slurm-{job}_1 attempt 1 on {second}\n", app

    # tasks 0 and 2: one run each, nothing excluded but n4, attempt 0
    for task in (0, 2):
        assert [run[0] for run in runs[task]] == ["COMPLETED"], where
        assert excluded(slurm, f"{job}_{task}") == "n4", where
        assert "excluding" not in batch[task], where
        node = runs[task][0][2]
        value = RUNS[task].split("=")[1]
        assert app[task] == f"value {value} run slurm-{job}_{task} attempt 0 on {node}\n", app

    # the table after the end, and one task's own status
    done = ddpkit(env, tmp_path, "status", job)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["task", "state", "attempt", "run", "id", "run"], done.stdout
    rows = [ROW.fullmatch(line) for line in lines[1:-1]]
    assert [row.groups() if row else None for row in rows] == [
        (f"{job}_{task}", "COMPLETED", str(attempt), f"slurm-{job}_{task}", RUNS[task])
        for task, attempt in enumerate([0, 1, 0])
    ], done.stdout
    assert lines[-1] == "# 3 runs: 3 COMPLETED", done.stdout
    one = ddpkit(env, tmp_path, "status", f"{job}_1")
    assert (one.returncode, one.stdout) == (
        0, f"COMPLETED (exit code 0)\nrun slurm-{job}_1 attempt 1\n"
    ), one.stderr  # fmt: skip


def ddpkit(env: dict[str, str], workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *args],
        env=env, cwd=workdir, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def excluded(slurm: SlurmCluster, job: str) -> str:
    shown = slurm.run("scontrol", "show", "job", "--oneliner", job).stdout
    return next(f for f in shown.split() if f.startswith("ExcNodeList=")).split("=", 1)[1]


def watch_table(env: dict[str, str], workdir: Path, job: str) -> list[tuple[int, str, str]]:
    """``ddpkit status ARRAY`` polled until every task has finished (bounded): each (task,
    attempt, run id) it showed on the way, the attempt "-" where it showed none."""
    shown: list[tuple[int, str, str]] = []
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        done = ddpkit(env, workdir, "status", job)
        assert done.returncode == 0, done.stderr
        rows = [ROW.fullmatch(line) for line in done.stdout.splitlines()[1:-1]]
        assert len(rows) == 3 and all(rows), done.stdout
        states = set()
        for row in rows:
            assert row is not None
            task, state, attempt, run_id, _ = row.groups()
            shown.append((int(task.partition("_")[2]), attempt, run_id))
            states.add(state)
        if states <= FINISHED:
            return shown
        time.sleep(0.5)
    pytest.fail(f"sweep {job} still not finished after {TIMEOUT_S} s: {shown}")
