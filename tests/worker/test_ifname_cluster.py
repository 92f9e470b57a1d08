"""On the real test cluster's nodes nb1, nb2 (partition ``badnet``, ``ci/slurm-up`` with
``DDPKIT_SLURM_BADNET=1``), where each node's own host name resolves to the address of a second
interface that no other node routes to (the first, eth0, is on the nodes' common network): a
2-node gloo group forms through ``ddpkit.init()`` under ``launch: srun``, which names eth0 (the
interface of the route to the rendezvous host) for gloo, and does not form through torch alone,
whose gloo listens where the host name resolves. The one difference between those two jobs
is that call: the same payload, MASTER_ADDR and MASTER_PORT, GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME unset, the same bound on the group's forming. A third job runs the torch-only
payload under ``ddpkit run`` (``launch: torchrun``): its agent names the interface for its
workers, so a script that never calls ddpkit forms its group too. The three jobs run at once,
one process a node."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ddpkit.cluster.rendezvous.ifname import IFNAME_VARS
from tests.support.needs import missing
from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = pytest.mark.slurm

PAYLOAD = Path(__file__).resolve().parents[1] / "scripts" / "group_over_nodes.py"
FORM_TIMEOUT_S = 20  # the bound on the group's forming (the collective timeout), both ways
# the rendezvous host is the first node; the port is the job's own, so both jobs can run at once
JOB = f"""#!/bin/bash
unset GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
srun --kill-on-bad-exit=1 {sys.executable} {PAYLOAD} --timeout {FORM_TIMEOUT_S} {{args}}
"""
RUN_SPEC = f"""name: ifname-run
partition: {{partition}}
nodes: 2
procs_per_node: 1
launch: torchrun
time_min: 3
workdir: {{workdir}}
log_dir: logs
command: {PAYLOAD} --timeout {FORM_TIMEOUT_S} --plain
"""


def _reports(text: str) -> list[dict[str, object]]:
    """The payload's JSON lines (under ``ddpkit run`` behind a ``[rankN]: `` prefix)."""
    return [json.loads(found) for found in re.findall(r'\{"rank".*\}', text)]


def test_a_group_over_nodes_whose_names_resolve_to_an_unroutable_address_forms_through_ddpkit(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    nodes = slurm.info.get("badnet_nodes")
    if not nodes:
        missing("the test cluster has no badnet partition: ci/slurm-up with DDPKIT_SLURM_BADNET=1")
    partition = slurm.info["badnet_partition"]
    slurm.env = {k: v for k, v in slurm.env.items() if k not in IFNAME_VARS}  # this test's own
    jobs = {}
    for way, args in (("ddpkit", ""), ("plain", "--plain")):
        options = (f"--partition={partition}", "--nodes=2", "--ntasks-per-node=1", "--time=3",
                   f"--job-name=ifname-{way}", f"--output={tmp_path / way}.out")  # fmt: skip
        jobs[way] = slurm.sbatch(JOB.format(args=args), cwd=tmp_path, args=options)
    spec = tmp_path / "run" / "job.yaml"
    spec.parent.mkdir()
    spec.write_text(RUN_SPEC.format(partition=partition, workdir=spec.parent))
    jobs["run"] = slurm.submit_spec(spec, home=tmp_path / "home")
    states = {way: slurm.wait(job, timeout_s=150) for way, job in jobs.items()}
    out = {
        way: (tmp_path / f"{way}.out").read_text(errors="replace") for way in ("ddpkit", "plain")
    }
    out["run"] = "\n".join(
        path.read_text(errors="replace") for path in sorted((spec.parent / "logs").glob("*"))
    )

    for way in ("ddpkit", "run"):
        assert states[way] == "COMPLETED", f"{way}: {out[way][-4000:]}"
        reports = _reports(out[way])
        assert sorted(str(r["node"]) for r in reports) == sorted(nodes), out[way][-4000:]
        assert [r["sum"] for r in reports] == [3, 3], out[way][-4000:]

    # torch alone: gloo listens on the address its host name resolves to, which the other node
    # has no route to: "Network is unreachable" at once, or the bound when packets are dropped
    assert states["plain"] in FINISHED - {"COMPLETED"}, out["plain"][-4000:]
    assert _reports(out["plain"]) == [], out["plain"][-4000:]
    assert re.search(
        r"ProcessGroupGloo.*(Network is unreachable|[Tt]imed? ?out)", out["plain"], re.S
    ), out["plain"][-4000:]
