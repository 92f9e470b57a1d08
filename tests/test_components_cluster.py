"""ddpkit as a torchx component on the real cluster: ``torchx run -s slurm`` (marker ``slurm``).

The rest (registration, validation, the spec conversion, local runs) is tests/test_components.py.
The ranks run tests/scripts/report_rank_env.py: these tests judge where torchx's SLURM jobs put
each rank, not a group, which forms over the same conversion's het components in
tests/jobs/test_torchx_jobs_cluster.py (a rank costs a Python start, not an ``import torch``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.slurm_cluster import SlurmCluster
from tests.test_components import REPORT, check_world, reports, torchx_cli

pytestmark = pytest.mark.slurm

RANKS_ONLY = REPORT.with_name("report_rank_env.py")  # torch-free, no group


def run_on_slurm(slurm: SlurmCluster, tmp_path: Path, j: str) -> tuple[str, list[dict[str, Any]]]:
    done = torchx_cli(
        "run", "--wait", "--workspace", "", "-s", "slurm", "-cfg", "partition=debug,time=5",
        "ddpkit.ddp", "-j", j, "--python", sys.executable, "--script", str(RANKS_ONLY),
        cwd=tmp_path, env=slurm.env,
    )  # fmt: skip
    output = done.stdout + done.stderr
    handle = re.search(r"slurm://torchx/(\d+)", output)
    assert handle, output
    job_id = slurm.track(handle[1])
    assert done.returncode == 0, output
    assert "Job finished: SUCCEEDED" in output, output
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob(f"slurm-{job_id}-*-*.out")))
    return job_id, reports(logs)


def het_nodes(slurm: SlurmCluster, job_id: str) -> list[str]:
    """The node of each het component (torchx: one per replica), from sacct."""
    done = slurm.run("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,NodeList")
    return [line.split("|")[1] for line in sorted(done.stdout.split())]


@pytest.mark.slow
def test_torchx_run_slurm_2x1(slurm: SlurmCluster, tmp_path: Path) -> None:
    job_id, found = run_on_slurm(slurm, tmp_path, "2x1")
    by_node = check_world(found, nodes=2, procs=1, grouped=False)
    nodes = het_nodes(slurm, job_id)
    assert len(nodes) == 2 and sorted(by_node) == sorted(nodes), (by_node, nodes)


@pytest.mark.slow
def test_torchx_run_slurm_1x2(slurm: SlurmCluster, tmp_path: Path) -> None:
    job_id, found = run_on_slurm(slurm, tmp_path, "1x2")
    by_node = check_world(found, nodes=1, procs=2, grouped=False)
    assert list(by_node) == het_nodes(slurm, job_id)
