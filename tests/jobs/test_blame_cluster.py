"""A rank killed on its node (SIGKILL, as the out-of-memory killer does) is blamed by the peer
watchdog of the ranks that survive it, and the bad-node exclusion requeues the job without that
node, on the real test cluster.

One job per launch mode (torchrun, srun), 2 nodes of n1..n3 (``sbatch: {exclude: n4}``), a
health check that always passes: in the first attempt the rank on the job's second node kills
itself after a few steps; the survivor's watchdog names it ("stopped sending heartbeats") and
writes its node to the job's blame file; after the failed step the exclusion reads it. The job
must run twice (REQUEUED, then COMPLETED), the second time without that node, and its log must
say why. What the second run is judged on is where SLURM put it and that it ends: its ranks only
say so, without ``import torch`` (~2 CPU-seconds a rank on the test machine) or a group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.cluster.nodelist import expand_nodelist
from tests.jobs.test_health_check_cluster import accounted, submit
from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = pytest.mark.slurm

APP = """import os, signal, sys, time
node = os.environ["SLURMD_NODENAME"]
if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":  # the requeued run: placement only
    print("app ran on", node, flush=True)
    sys.exit(0)
import torch, torch.distributed as dist
import ddpkit
from ddpkit.cluster.nodelist import expand_nodelist
ctx = ddpkit.init()
second = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])[1]
value = torch.ones(1)
for step in range(40):
    dist.all_reduce(value)
    if step == 5 and node == second:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
print("app ran on", node, flush=True)
ddpkit.shutdown()
"""


@pytest.mark.parametrize("launch", ["torchrun", "srun"])
def test_a_killed_ranks_node_is_excluded_and_the_job_completes(
    slurm_cluster: SlurmCluster, tmp_path: Path, launch: str
) -> None:
    slurm = slurm_cluster
    if not slurm.accounting:
        pytest.fail("this test reads the job's runs from sacct: start ci/slurm-up with accounting")
    fields = (
        f"nodes: 2\nlaunch: {launch}\nhealth_check: 'true'\n"
        "env: {DDPKIT_PEER_TIMEOUT: '4', OMP_NUM_THREADS: '1'}\n"
    )
    job = submit(slurm, tmp_path, "blamed", fields, APP)
    try:
        state = slurm.wait(job, timeout_s=180, states=FINISHED)
        runs = accounted(slurm, job)
        log = (tmp_path / "logs" / f"blamed-{job}.out").read_text(errors="replace")
        where = f"job {job}: {runs}\n{log}"
        assert state == "COMPLETED", where
        assert [run[0] for run in runs] == ["REQUEUED", "COMPLETED"], where
        first, second = (expand_nodelist(run[2]) for run in runs)
        bad = first[1]
        assert bad not in second and len(second) == 2, where
        assert f"ddpkit: excluding node {bad} (the watchdog after the job's step exited" in log
        assert "stopped sending heartbeats" in log, where
    finally:
        slurm.cancel_tracked()
