"""``launch: torchrun`` on the real cluster: global ranks follow SLURM's node order, always.

torch's c10d rendezvous orders its agents by their address, then pid; SLURM orders the job's
nodes by its own node table. The test cluster's names (n1, n2) sort alike, so each job's
``python`` is a wrapper that hands ``ddpkit run`` a ``--local-addr`` sorting the other way (node
0 by name, the others by IP address: digits sort before letters, as ``node10`` sorts before
``node9`` on a real cluster), and can start one node's agent late or give the agents a restart.
Several 2 x 2 jobs run at once while a CPU hog runs; every rank's (rank, host) is checked
against SLURM's node order (``scontrol show job``). Before the fix, every "reversed" job put
ranks 0-1 on the second node. The ranks come from the agents, so the jobs run at once report
them torch-free (tests/scripts/report_rank_env.py: a Python start a rank, no ``import torch``);
the restarted job's ranks (2 x 1) also form their group and all-reduce over it (report_rank.py):
the workers' store moves with the new rank 0.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpkit.jobs import api
from ddpkit.jobs.spec import JobSpec
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = ROOT / "tests" / "scripts" / "report_rank.py"  # joins the group: all_reduce's sum
# torch-free (ranks as the agents gave them, no group): where each rank is needs no more
RANKS_ONLY = ROOT / "tests" / "scripts" / "report_rank_env.py"
JOB_TIMEOUT_S = 300  # several jobs of 6 Python processes each on a loaded 2-core machine

WRAPPER = """#!/bin/bash
# The job's python. `python -u -m ddpkit run ...` (one agent per node) gets --local-addr: the
# node's name, or with ORDER_TEST_ADDR=reversed its IP address on nodes other than node 0;
# ORDER_TEST_DELAY_NODE's agent starts ORDER_TEST_DELAY_S late; --max-restarts from the env.
py={python}
if [ "$1 $2 $3 $4" = "-u -m ddpkit run" ]; then
  shift 4
  host=$(hostname)
  addr=$host
  if [ "${{ORDER_TEST_ADDR:-}}" = reversed ] && [ "$SLURM_NODEID" != 0 ]; then
    addr=$(getent hosts "$host" | awk '{{print $1; exit}}')
  fi
  if [ "$SLURM_NODEID" = "${{ORDER_TEST_DELAY_NODE:-none}}" ]; then
    sleep "$ORDER_TEST_DELAY_S"
  fi
  echo "agent of node $SLURM_NODEID ($host): --local-addr $addr" >&2
  exec "$py" -u -m ddpkit run --local-addr "$addr" \\
    --max-restarts "${{ORDER_TEST_RESTARTS:-0}}" "$@"
fi
exec "$py" "$@"
"""

# A worker of node 1 fails before joining on the first attempt: both agents restart theirs.
FAIL_ONCE = """import os, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["SLURM_NODEID"] == "1":
    if os.environ["LOCAL_RANK"] == "0":
        sys.exit(3)
sys.argv[1:] = []
import runpy
print("restart", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
runpy.run_path({payload!r}, run_name="__main__")
"""


@pytest.fixture
def workdir(slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(key, slurm.env[key])
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    wrapper = tmp_path / "python.sh"
    wrapper.write_text(WRAPPER.format(python=sys.executable))
    wrapper.chmod(0o755)
    return tmp_path


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """One busy process for the test's duration: the agents start and join at uneven times.
    At the lowest priority: on an idle machine it still takes a core from them, and in the CI
    run, whose cores are busy throughout, it takes almost nothing from the other tests."""
    hog = subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait(timeout=10)


def submit(
    slurm: SlurmCluster, workdir: Path, name: str, command: list[str], per_node: int, **env: str
) -> str:
    spec = JobSpec(
        name=name,
        command=command,
        python=str(workdir / "python.sh"),
        nodes=2,
        procs_per_node=per_node,
        launch="torchrun",
        time_min=10,
        workdir=str(workdir),
        env=env,
    )
    return slurm.track(api.submit(spec, "sbatch").job_id)


def slurm_nodes(slurm: SlurmCluster, job: str) -> list[str]:
    """The job's nodes in SLURM's order (SLURM_NODEID 0, 1, ...)."""
    shown = slurm.run("scontrol", "show", "job", "--oneliner", job).stdout
    nodelist = re.search(r"(?:^|\s)NodeList=(\S+)", shown)
    assert nodelist is not None, shown
    return slurm.run("scontrol", "show", "hostnames", nodelist.group(1)).stdout.split()


def rank_reports(workdir: Path, name: str, job: str) -> tuple[list[dict[str, Any]], str]:
    """Every rank's JSON line from the job's node files, by rank; and the files' text."""
    text = "".join(
        path.read_text(errors="replace")
        for path in sorted((workdir / "ddpkit-logs").glob(f"{name}-{job}-node*.out"))
    )
    found = [_first_json(line[line.index('{"rank"') :]) for line in text.splitlines()
             if '{"rank"' in line]  # fmt: skip
    return sorted(found, key=lambda r: r["rank"]), text


def placement_problem(
    slurm: SlurmCluster, workdir: Path, name: str, job: str, per_node: int, *, grouped: bool = True
) -> str | None:
    """None when the job completed with rank r on SLURM's node r // ``per_node`` (and,
    ``grouped``, its ranks formed one group: the all_reduce's sum); else what went wrong (with
    the job's output)."""
    state = slurm.wait(job, timeout_s=JOB_TIMEOUT_S)
    found, text = rank_reports(workdir, name, job)
    if state != "COMPLETED":
        return f"{name} ({job}): {state}\n{text}"
    nodes = slurm_nodes(slurm, job)
    placed = [(r["rank"], r["local_rank"], r["node"]) for r in found]
    world = 2 * per_node
    expected = [(rank, rank % per_node, nodes[rank // per_node]) for rank in range(world)]
    total = world * (world + 1) // 2
    sums = {r["sum"] for r in found} if grouped else {total}
    if placed != expected or {r["world_size"] for r in found} != {world} or sums != {total}:
        return f"{name} ({job}): (rank, local rank, node) {placed}, SLURM's order {nodes}"
    return None


# name: the job's ORDER_TEST_* variables; a late node's agent starts 4 s late. No variant
# without reversal or delay: every torchrun job of the suite is one (tests/jobs/
# test_jobs_cluster.py's ranks job checks the same placement). With reversed addresses node 0's
# agent joins 4 s after node 1's, 4 s before it, or at the same time (under the hog's load,
# their joins land anywhere within a second or so of each other).
VARIANTS = {
    "rev-late0": {"ORDER_TEST_ADDR": "reversed", "ORDER_TEST_DELAY_NODE": "0"},
    "rev-late1": {"ORDER_TEST_ADDR": "reversed", "ORDER_TEST_DELAY_NODE": "1"},
    "rev": {"ORDER_TEST_ADDR": "reversed"},
    "plain-late0": {"ORDER_TEST_DELAY_NODE": "0"},
}


@pytest.mark.slow
@pytest.mark.usefixtures("cpu_hog")
def test_ranks_follow_slurm_node_order_in_jobs_started_together_under_load(
    slurm: SlurmCluster, workdir: Path
) -> None:
    jobs = {
        name: submit(
            slurm,
            workdir,
            name,
            [str(RANKS_ONLY)],
            2,
            **variables,
            ORDER_TEST_DELAY_S="4",
        )
        for name, variables in VARIANTS.items()
    }
    problems = [
        placement_problem(slurm, workdir, name, job, 2, grouped=False) for name, job in jobs.items()
    ]
    assert not any(problems), "\n".join(p for p in problems if p)


@pytest.mark.slow
def test_ranks_keep_slurm_node_order_after_a_restart(slurm: SlurmCluster, workdir: Path) -> None:
    (workdir / "fail_once.py").write_text(FAIL_ONCE.format(payload=str(PAYLOAD)))
    job = submit(
        slurm,
        workdir,
        "restart",
        [str(workdir / "fail_once.py")],
        1,  # a rank a node: where each rank runs after the restart needs no more
        ORDER_TEST_ADDR="reversed",
        ORDER_TEST_RESTARTS="1",
    )
    problem = placement_problem(slurm, workdir, "restart", job, 1)
    text = rank_reports(workdir, "restart", job)[1]
    assert problem is None, f"{problem}\n{text}"
    # node 1's agent restarted after its worker failed; node 0's restarted on seeing it rejoin
    # (a membership change: torch keeps its TORCHELASTIC_RESTART_COUNT at 0)
    assert "failed (exitcode: 3)" in text and text.count("restart 1") == 1, text


def _first_json(text: str) -> dict[str, Any]:
    """The JSON object ``text`` starts with; what follows it on the line is left (under load a
    peer's tee'd output can land on the same line of the shared node log)."""
    found, _ = json.JSONDecoder().raw_decode(text)
    return dict(found)
