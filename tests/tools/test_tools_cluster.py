"""``ddpkit doctor`` on the real SLURM test cluster (2 nodes in their own network namespaces;
marker ``slurm``): a healthy 2-node step passes and sweeps across the nodes; torchrun inside a
2-task step, and a loopback MASTER_ADDR on a 2-node job, fail with the right hint.

The three jobs are submitted together (module fixture) and judged by separate tests.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ddpkit
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

SRC = Path(ddpkit.__file__).resolve().parents[1]
DOCTOR = f"{shlex.quote(sys.executable)} -m ddpkit"
JOBS = {
    "healthy": ("--nodes=2 --ntasks-per-node=2", f"srun {DOCTOR} doctor --quick --timeout 60"),
    "nested": (
        "--nodes=1 --ntasks-per-node=2",
        f"srun {DOCTOR} run --nproc-per-node 2 -m ddpkit doctor --no-comm --timeout 20",
    ),
    "loopback": (
        "--nodes=2 --ntasks-per-node=1",
        f"export MASTER_ADDR=127.0.0.1 MASTER_PORT=29555\nsrun {DOCTOR} doctor --no-comm "
        "--timeout 5",
    ),
}


@pytest.fixture(scope="module")
def outputs(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[str, str]]]:
    """name -> (final state, output) of each job, all submitted at once."""
    folder = tmp_path_factory.mktemp("doctor")
    handle = SlurmCluster(slurm_cluster.env, slurm_cluster.info)
    jobs = {}
    for name, (options, body) in JOBS.items():
        script = (
            f"#!/bin/bash\n#SBATCH {options} --time=5 --output={folder}/{name}.out\n"
            f"export PYTHONPATH={shlex.quote(str(SRC))}\n{body}\n"
        )
        jobs[name] = handle.sbatch(script, cwd=folder)
    try:
        states = {name: handle.wait(job, timeout_s=180) for name, job in jobs.items()}
        yield {name: (states[name], (folder / f"{name}.out").read_text()) for name in jobs}
    finally:
        handle.cancel_tracked()


def test_two_nodes_pass_and_sweep_across_them(outputs: dict[str, tuple[str, str]]) -> None:
    state, text = outputs["healthy"]
    assert state == "COMPLETED", text
    checks = [line for line in text.splitlines() if line.split(" ")[0] in ("PASS", "WARN", "FAIL")]
    assert all(line.startswith("PASS") for line in checks), text
    assert "PASS launcher: slurm: rank 0 of 4, node 0 of 2" in text
    # the two nodes SLURM picked: n1 and n2 on an idle cluster, others while other jobs run
    layout = r"PASS layout: 4 ranks on 2 node\(s\) \((n\d): 2, (n\d): 2\), launcher slurm"
    assert re.search(layout, text), text
    assert re.search(r"PASS gloo interface: eth0 \(10\.219\.17\.\d+\)", text), text
    assert "PASS all_reduce gloo: 4 ranks on 2 node(s), sum correct" in text
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("gloo ")]
    peak = max(rows, key=lambda r: float(r[4]))  # the summary names the size of the peak busbw
    assert f"peak busbw {peak[4]} GB/s (algbw {peak[3]} GB/s) at {peak[1]} B" in text, text
    assert [int(row[1]) for row in rows] == [4, 4096, 262144, 4194304]
    # busbw = algbw * 2(n-1)/n = 1.5 algbw for 4 ranks, both printed with 3 decimals
    assert all(float(r[4]) == pytest.approx(1.5 * float(r[3]), abs=2e-3) for r in rows), rows


def test_torchrun_inside_a_two_task_step_fails_with_the_hint(
    outputs: dict[str, tuple[str, str]],
) -> None:
    state, text = outputs["nested"]
    assert state == "FAILED", text
    fails = [line for line in text.splitlines() if "FAIL launcher: srun started 2 tasks" in line]
    assert fails, text  # (the agent may stop a worker before it prints)
    assert all("hint: run one torchrun per node" in line for line in fails)


def test_loopback_master_on_two_nodes_fails_with_the_hint(
    outputs: dict[str, tuple[str, str]],
) -> None:
    state, text = outputs["loopback"]
    assert state == "FAILED", text
    assert text.count("FAIL master address: the job spans 2 nodes but MASTER_ADDR=127.0.0.1") == 2
    assert "hint: set MASTER_ADDR to rank 0's host name" in text
    assert "FAIL ranks: 1 of 2 ranks never showed up within 5 s: 1" in text  # rank 0's view
    assert "FAIL master reachable: rank 1 cannot reach" in text  # rank 1's own line
