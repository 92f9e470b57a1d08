"""Bad nodes on the real test cluster: a spec's ``health_check`` blames a node, the job is
requeued without it and completes on others; past ``max_excluded_nodes`` it fails, saying so.

The jobs are confined to n1..n3 (``sbatch: {exclude: n4}``, which must stay in the job's
``ExcNodeList`` and not count against the cap) and submitted together:

* ``one-bad``: 2 nodes, ``launch: torchrun``; the check fails on the first node of the first
  attempt (it writes that node's name to a file, and fails wherever the file names the node).
  The job must run twice (sacct: REQUEUED, then COMPLETED), the second time on the two other
  nodes, with ``ExcNodeList`` = n4 + the bad node, and the job's log must say why;
* ``everywhere``: 1 node, ``max_excluded_nodes: 1``, a check that fails on every node: the
  first attempt excludes its node, the second fails the job (exit code 1) with the message,
  the command never runs and nothing of the job is left running;
* ``after-step``: 2 nodes, ``launch: srun``, a check that passes at the start; rank 1 of the
  first attempt marks its node bad and fails: the check after the failed step blames that node,
  and the job completes on the two others.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddpkit.cluster.nodelist import expand_nodelist
from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = pytest.mark.slurm

ALL = ["n1", "n2", "n3", "n4"]
APP = 'import os\nprint("app ran on", os.environ["SLURMD_NODENAME"], flush=True)\n'
FIRST_BAD = """#!/bin/bash
# the first attempt's first node is bad: it names itself in ./bad; a node named there fails
cd -- "$(dirname -- "$0")"
first="$({python} -c 'import os; from ddpkit.cluster.nodelist import first_host
print(first_host(os.environ["SLURM_JOB_NODELIST"]))')"
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] && [ "$SLURMD_NODENAME" = "$first" ]; then
  echo "$first" > "bad.$first" && mv "bad.$first" bad
fi
if [ "$SLURMD_NODENAME" = "$(cat bad 2>/dev/null)" ]; then
  echo "node $SLURMD_NODENAME is marked bad by the test"; exit 1
fi
"""


# rank 1 of the first attempt marks its node bad, then fails (rank 0 waits to be ended by
# srun's --kill-on-bad-exit); every later attempt just runs
APP_BREAKS = """import os, time
node = os.environ["SLURMD_NODENAME"]
if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    if os.environ["SLURM_PROCID"] == "1":
        with open("bad.tmp", "w") as out:
            out.write(node)
        os.replace("bad.tmp", "bad")
        raise SystemExit(f"rank 1 on {node}: this node just went bad")
    time.sleep(60)
print("app ran on", node, flush=True)
"""
MARKED_BAD = """#!/bin/bash
cd -- "$(dirname -- "$0")"
if [ "$SLURMD_NODENAME" = "$(cat bad 2>/dev/null)" ]; then
  echo "node $SLURMD_NODENAME is marked bad by the job"; exit 1
fi
"""


@dataclass
class Outcome:
    job: str
    workdir: Path
    state: str
    runs: list[tuple[str, str, str]]  # (State, ExitCode, NodeList) of each run, oldest first
    excluded: str  # ExcNodeList after the job
    log: str  # the batch script's log
    app: str  # the command's output, every rank


def submit(slurm: SlurmCluster, workdir: Path, name: str, fields: str, app: str = APP) -> str:
    (workdir / "app.py").write_text(app)
    spec = workdir / "job.yaml"
    spec.write_text(
        f"name: {name}\npartition: debug\nprocs_per_node: 1\ntime_min: 3\nworkdir: {workdir}\n"
        f"log_dir: logs\npython: {sys.executable}\ncommand: app.py\n"
        f"sbatch: {{exclude: n4}}\nhealth_check_timeout_s: 20\n{fields}"
    )
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "submit", str(spec)],
        env={**slurm.env, "DDPKIT_HOME": str(workdir / "home")},
        cwd=workdir, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return slurm.track(done.stdout.strip())


def accounted(slurm: SlurmCluster, job: str, timeout_s: float = 30) -> list[tuple[str, str, str]]:
    """sacct's runs of ``job`` once it has recorded the last one's end (it lags scontrol)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = slurm.run(
            "sacct", "-j", job, "--duplicates", "-n", "-P", "-X", "-o", "State,ExitCode,NodeList"
        ).stdout
        runs = [tuple(line.split("|")) for line in out.splitlines() if line.strip()]
        if (runs and runs[-1][0] in FINISHED) or time.monotonic() > deadline:
            return runs  # type: ignore[return-value]
        time.sleep(0.2)


def outcome(slurm: SlurmCluster, job: str, workdir: Path) -> Outcome:
    state = slurm.wait(job, timeout_s=150, states=FINISHED)
    runs = accounted(slurm, job)
    shown = slurm.run("scontrol", "show", "job", "--oneliner", job).stdout
    excluded = next(f for f in shown.split() if f.startswith("ExcNodeList=")).split("=", 1)[1]
    logs = workdir / "logs"
    return Outcome(
        job,
        workdir,
        state,
        runs,
        excluded,
        (logs / f"{workdir.name}-{job}.out").read_text(errors="replace"),
        "".join(
            p.read_text(errors="replace") for p in sorted(logs.glob(f"{workdir.name}-{job}-*.out"))
        ),
    )


@pytest.fixture(scope="module")
def outcomes(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Outcome]:
    slurm = slurm_cluster
    if not slurm.accounting:
        pytest.fail("these tests read the job's runs from sacct: start ci/slurm-up with accounting")
    one_bad = tmp_path_factory.mktemp("hc-one-bad", numbered=False)
    everywhere = tmp_path_factory.mktemp("hc-everywhere", numbered=False)
    after_step = tmp_path_factory.mktemp("hc-after-step", numbered=False)
    (one_bad / "check.sh").write_text(FIRST_BAD.format(python=sys.executable))
    (after_step / "check.sh").write_text(MARKED_BAD)
    check = f"bash {one_bad / 'check.sh'}"
    try:
        jobs = {
            "one-bad": (submit(slurm, one_bad, one_bad.name,
                               f"nodes: 2\nlaunch: torchrun\nhealth_check: {check}\n"),
                        one_bad),
            "everywhere": (
                submit(slurm, everywhere, everywhere.name,
                       "nodes: 1\nmax_excluded_nodes: 1\n"
                       "health_check: echo \"broken on $SLURMD_NODENAME\"; exit 1\n"),
                everywhere,
            ),
            "after-step": (
                submit(slurm, after_step, after_step.name,
                       f"nodes: 2\nhealth_check: bash {after_step / 'check.sh'}\n", APP_BREAKS),
                after_step,
            ),
        }  # fmt: skip
        return {name: outcome(slurm, job, workdir) for name, (job, workdir) in jobs.items()}
    finally:
        slurm.cancel_tracked()


def test_a_bad_node_is_excluded_and_the_job_completes_on_two_others(
    outcomes: dict[str, Outcome],
) -> None:
    found = outcomes["one-bad"]
    where = f"job {found.job}: {found.runs}\n{found.log}"
    bad = (found.workdir / "bad").read_text().strip()
    assert bad in ALL[:3], where
    assert found.state == "COMPLETED", where
    assert [run[0] for run in found.runs] == ["REQUEUED", "COMPLETED"], where
    first, second = (set(_hosts(run[2])) for run in found.runs)
    assert bad in first and len(first) == 2, where
    assert bad not in second and "n4" not in second and len(second) == 2, where
    assert sorted(_hosts(found.excluded)) == sorted(["n4", bad]), where
    assert (
        f"ddpkit: excluding node {bad} (health check failed: exit code 1: node {bad} is marked "
        f"bad by the test); requeue attempt 1, excluded: {bad} (1 of max 2)"
    ) in found.log, where
    others = ", ".join(sorted(second, key=ALL.index))
    assert f"ddpkit: health check passed on {others} (attempt 1)" in found.log, where
    ran = sorted(line.split()[-1] for line in found.app.splitlines() if "app ran on" in line)
    assert ran == sorted(second), found.app  # the command ran only after the exclusion


def test_past_the_cap_the_job_fails_with_the_reason_and_nothing_left(
    slurm_cluster: SlurmCluster, outcomes: dict[str, Outcome]
) -> None:
    found = outcomes["everywhere"]
    where = f"job {found.job}: {found.runs}\n{found.log}"
    assert found.state == "FAILED", where
    assert [run[:2] for run in found.runs] == [("REQUEUED", "0:0"), ("FAILED", "1:0")], where
    first, second = (run[2] for run in found.runs)
    assert first != second and "n4" not in (first, second), where
    assert sorted(_hosts(found.excluded)) == sorted(["n4", first]), where
    assert (
        f"ddpkit: excluding node {first} (health check failed: exit code 1: broken on {first}); "
        f"requeue attempt 1, excluded: {first} (1 of max 1)"
    ) in found.log, where
    assert (
        f"ddpkit: not excluding {second}: max_excluded_nodes=1 would be exceeded (2 nodes; "
        f"excluded so far: {first}); the job fails"
    ) in found.log, where
    assert "app ran on" not in found.app, found.app
    assert slurm_cluster.processes(str(found.workdir)) == []


def _hosts(nodelist: str) -> list[str]:
    return expand_nodelist(nodelist)


def test_a_node_that_fails_its_check_after_the_step_failed_is_excluded(
    outcomes: dict[str, Outcome],
) -> None:
    found = outcomes["after-step"]
    where = f"job {found.job}: {found.runs}\n{found.log}"
    bad = (found.workdir / "bad").read_text().strip()
    assert found.state == "COMPLETED", where
    assert [run[0] for run in found.runs] == ["REQUEUED", "COMPLETED"], where
    first, second = (set(_hosts(run[2])) for run in found.runs)
    assert bad in first and bad not in second and len(second) == 2, where
    assert sorted(_hosts(found.excluded)) == sorted(["n4", bad]), where
    assert (
        f"ddpkit: health check passed on {', '.join(sorted(first, key=ALL.index))} (attempt 0)"
        in (found.log)
    ), where
    # srun's own code: the failed task's 1, or 143 when srun reports the step it terminated
    excluding = re.search(
        f"ddpkit: excluding node {bad} \\(health check failed after the job's step exited "
        f"[0-9]+: exit code 1: node {bad} is marked bad by the job\\); requeue attempt 1, "
        f"excluded: {bad} \\(1 of max 2\\)\n",
        found.log,
    )
    assert excluding, where
    ran = sorted(line.split()[-1] for line in found.app.splitlines() if "app ran on" in line)
    assert ran == sorted(second), found.app
