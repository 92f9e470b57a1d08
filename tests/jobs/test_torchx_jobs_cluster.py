"""``ddpkit submit --via torchx`` on the real SLURM of ``ci/slurm-up`` (marker ``slurm``).

2 nodes x 1 process, and a cancel after which torchx's own status raises but ddpkit's must not.
Payload: tests/scripts/report_rank.py. Dry runs, bad input and local runs:
tests/jobs/test_torchx_jobs.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ddpkit.jobs.records import record_key
from tests.jobs.test_torchx_jobs import ROOT, reports, write_spec
from tests.support.slurm_cluster import SlurmCluster

# the group forms and all-reduces over torchx's het components on SLURM (the local runs
# in test_torchx_jobs.py are torch-free); --sleep keeps a job running to be cancelled
REPORT_RANK = ROOT / "tests" / "scripts" / "report_rank.py"

pytestmark = pytest.mark.slurm


# --- the real SLURM -----------------------------------------------------------------------------


def ddpkit(slurm: SlurmCluster, workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *args],
        cwd=workdir,
        env={**slurm.env, "DDPKIT_HOME": str(workdir / "home")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def submit(slurm: SlurmCluster, workdir: Path, spec: Path) -> tuple[str, str]:
    done = ddpkit(slurm, workdir, "submit", str(spec), "--via", "torchx", "--scheduler", "slurm")
    assert done.returncode == 0, done.stderr
    match = re.fullmatch(r"slurm://torchx/(\d+)\n", done.stdout)
    assert match is not None, done.stdout
    return done.stdout.strip(), slurm.track(match.group(1))


def wait_status(slurm: SlurmCluster, workdir: Path, job: str, prefix: str) -> str:
    deadline = time.monotonic() + 120
    shown = ""
    while time.monotonic() < deadline:
        done = ddpkit(slurm, workdir, "status", job)
        assert "Traceback" not in done.stderr, done.stderr
        shown = done.stdout
        if shown.startswith(prefix):
            return shown
        time.sleep(1)
    pytest.fail(f"status of {job} still {shown!r}, not {prefix}")


def het_nodes(slurm: SlurmCluster, job_id: str) -> dict[int, str]:
    """Het component k of the job -> the node SLURM put it on."""
    shown = slurm.run("scontrol", "show", "job", "--oneliner", job_id).stdout
    nodes = {}
    for line in shown.splitlines():
        offset = re.search(r"HetJobOffset=(\d+)", line)
        nodelist = re.search(r"(?:^|\s)NodeList=(\S+)", line)
        if offset and nodelist:
            nodes[int(offset.group(1))] = nodelist.group(1)
    return nodes


def test_slurm_two_nodes_one_process_each(slurm: SlurmCluster, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "nodes: 2\n", payload=REPORT_RANK)
    handle, job_id = submit(slurm, tmp_path, spec)
    shown = f"COMPLETED (exit code 0)\nrun slurm-{job_id} attempt 0\n"  # the run: SLURM's job
    assert wait_status(slurm, tmp_path, handle, "COMPLETED") == shown
    assert ddpkit(slurm, tmp_path, "status", job_id).stdout == shown
    nodes = het_nodes(slurm, job_id)
    assert sorted(nodes) == [0, 1] and len(set(nodes.values())) == 2
    for k, node in nodes.items():  # replica k ran on het component k's node
        out = (tmp_path / f"slurm-{job_id}-demo-{k}.out").read_text()
        assert [r["node"] for r in reports(out)] == [node]
    logs = ddpkit(slurm, tmp_path, "logs", handle).stdout
    found = sorted(reports(logs), key=lambda r: r["rank"])
    assert [(r["rank"], r["world_size"], r["sum"]) for r in found] == [(0, 2, 3), (1, 2, 3)]
    # ranks in SLURM's node order here too: one srun over the components, SLURM_NODEID 0, 1
    assert [r["node"] for r in found] == [nodes[0], nodes[1]]
    for rank in (0, 1):
        text = ddpkit(slurm, tmp_path, "logs", handle, "--rank", str(rank)).stdout
        assert [r["rank"] for r in reports(text)] == [rank]
    record = load_record_in(tmp_path, handle)
    assert record["via"] == "torchx" and "#SBATCH hetjob" in record["script"]


def load_record_in(workdir: Path, handle: str) -> dict[str, Any]:
    path = workdir / "home" / "jobs" / f"{record_key(handle)}.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_slurm_cancel_then_status_is_cancelled_where_torchx_raises(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    marker = f"ddpkit-torchx-cancel-{uuid.uuid4().hex}"
    spec = write_spec(tmp_path, "nodes: 2\n", args=f"--sleep 300 {marker}", payload=REPORT_RANK)
    handle, job_id = submit(slurm, tmp_path, spec)
    wait_status(slurm, tmp_path, handle, "RUNNING")
    done = ddpkit(slurm, tmp_path, "cancel", handle)
    assert (done.returncode, done.stdout) == (0, ""), done.stderr
    slurm.wait(job_id, timeout_s=60)
    assert wait_status(slurm, tmp_path, handle, "CANCELLED").startswith("CANCELLED")
    torchx_says = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from torchx.runner import get_runner; get_runner().status({handle!r})",
        ],
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if slurm.accounting:  # torchx 0.7 reads sacct's "CANCELLED by 0" and asserts
        assert "failed to translate slurm state CANCELLED by" in torchx_says.stderr
    deadline = time.monotonic() + 30
    while slurm.processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not slurm.processes(marker), "the job's processes outlived the cancel"
