"""``--via torchx`` on the real cluster: the spec's account and QOS are the job's (``slurm``).

An account and a QOS made for the test with sacctmgr must be the job's, in every het component.
Its ranks run tests/scripts/report_rank_env.py: what is judged is SLURM's record of the job, not
its ranks' group (a real group over torchx's het components forms in
tests/jobs/test_torchx_jobs_cluster.py), and a rank costs a Python start, not an ``import torch``.
The dry runs are tests/jobs/test_torchx_sbatch.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs.test_torchx_sbatch import HOSTILE, PAYLOAD
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

RANKS_ONLY = PAYLOAD.with_name("report_rank_env.py")  # torch-free, no group


# --- the real SLURM -----------------------------------------------------------------------------


def sacctmgr(slurm: SlurmCluster, *args: str) -> None:
    slurm.run("sacctmgr", "-i", *args)


@pytest.fixture
def account_and_qos(slurm: SlurmCluster) -> Iterator[tuple[str, str]]:
    """An account (with root's association) and a QOS of this test's own, removed afterwards.
    Without them SLURM (no AccountingStorageEnforce here) would silently run the job under the
    default account and QOS, and the test could not tell."""
    if not slurm.accounting:
        pytest.fail("the test cluster runs without accounting: rerun ci/slurm-up")
    account, qos = f"dk{os.getpid()}acct", f"dk{os.getpid()}qos"
    sacctmgr(slurm, "add", "qos", qos)
    try:
        sacctmgr(slurm, "add", "account", account, "Description=ddpkit-test", "Organization=ddpkit")
        try:
            sacctmgr(slurm, "add", "user", "root", f"account={account}", f"qos=normal,{qos}")
            yield account, qos
        finally:
            slurm.run("sacctmgr", "-i", "delete", "user", "name=root", f"account={account}")
            slurm.run("sacctmgr", "-i", "delete", "account", account, check=False)
    finally:
        slurm.run("sacctmgr", "-i", "delete", "qos", qos, check=False)


# ~15 s: a real 2-node job, then its accounting record
def test_slurm_job_runs_under_the_specs_account_and_qos(
    slurm: SlurmCluster, tmp_path: Path, account_and_qos: tuple[str, str]
) -> None:
    account, qos = account_and_qos
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: demo\ncommand: {RANKS_ONLY}\ntime_min: 5\nnodes: 2\naccount: {account}\n"
        f"qos: {qos}\nsbatch: {{comment: {json.dumps(HOSTILE)}}}\n"
    )
    env = {**slurm.env, "DDPKIT_HOME": str(tmp_path / "home")}
    argv = [sys.executable, "-m", "ddpkit", "submit", str(spec), "--via", "torchx"]
    done = subprocess.run(
        [*argv, "--scheduler", "slurm"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    match = re.fullmatch(r"slurm://torchx/(\d+)\n", done.stdout)
    assert match is not None, done.stdout
    job = slurm.track(match.group(1))
    shown = slurm.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%i|%a|%q|%k").stdout
    rows = [line.split("|", 3) for line in shown.splitlines()]
    assert [(a, q, c) for _, a, q, c in rows] == [(account, qos, HOSTILE)] * 2, shown
    assert slurm.wait(job, timeout_s=120) == "COMPLETED"
    deadline = time.monotonic() + 30  # the accounting database learns of the job a bit later
    while True:
        listed = slurm.run("sacct", "-n", "-X", "-P", "-j", job, "-o", "Account,QOS").stdout
        if listed.split() == [f"{account}|{qos}"] * 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert listed.split() == [f"{account}|{qos}"] * 2, listed
