"""Port collisions on the real SLURM cluster of ``ci/slurm-up`` (2 nodes in their own network
namespaces, ``MpiParams=ports=12000-12999``; marker ``slurm``).

Each job is submitted held, so its id (and with it its derived ports) is known before it runs;
the test then occupies those ports on the job's first node, inside that node's namespace, and
releases the job. A 2-node job must still complete with every rank in place: through the port
SLURM reserved for the step (the generated script asks for one), and without a reservation
(``srun --resv-ports=0``, as on a cluster without ``MpiParams=ports=``) through the candidates;
for ``launch: srun`` (the ranks' store) and ``launch: torchrun`` (the c10d rendezvous store of
the ``ddpkit run`` agents). The ranks of ``launch: srun`` (one a node: each imports torch)
join their group through the port (tests/scripts/report_port.py); under torchrun the agents
meet there and their ranks, two a node, report where they were placed torch-free
(tests/scripts/report_port_env.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

import ddpkit
from ddpkit.cluster.rendezvous.endpoint import RDZV_STEP
from ddpkit.cluster.rendezvous.ports import candidate_ports
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[3]
PAYLOAD = ROOT / "tests" / "scripts" / "report_port.py"
# torchrun's ports are the agents': its ranks report torch-free (no group, no `sum`)
AGENTS_ONLY = ROOT / "tests" / "scripts" / "report_port_env.py"
SRC = Path(ddpkit.__file__).resolve().parent
JOB_TIMEOUT_S = 180
FIRST_NODE = "n1"  # every 2-node job here asks for n[1-2] (the cluster may have more nodes)
NODES = "n[1-2]"

# A plain listener that never answers; with --store, a torch store of another job instead.
_SQUAT = """
import socket, sys
if sys.argv[2] == "store":
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore("0.0.0.0", int(sys.argv[1]), 1, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=600))
    store.set("ddpkit/job", "slurm job other step 0 restart 0")
else:
    sock = socket.socket()
    sock.bind(("0.0.0.0", int(sys.argv[1])))
    sock.listen()
print("ready", flush=True)
sys.stdin.read()  # hold the port until the test closes our stdin
"""


@contextmanager
def squat(slurm: SlurmCluster, node: str, port: int, kind: str) -> Iterator[None]:
    """Hold ``port`` on ``node`` (inside its network namespace) for the block's duration."""
    netns = slurm.info.get("netns_prefix", "ddpkit-") + node  # ci/slurm-up's name for it
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", _SQUAT, str(port), kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=slurm.env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)


def reports(text: str) -> list[dict[str, Any]]:
    """The JSON lines of report_port.py (torchrun's "[rankN]: " prefix removed)."""
    return [_first_json(line[line.index('{"rank"') :]) for line in text.splitlines()
            if '{"rank"' in line]  # fmt: skip


def check_ranks(found: list[dict[str, Any]], per_node: int, *, grouped: bool = True) -> None:
    """``per_node`` ranks on each of n1, n2 in block order, our ddpkit everywhere; ``grouped``:
    one all_reduce over them (report_port.py)."""
    world = 2 * per_node
    nodes = [FIRST_NODE] * per_node + ["n2"] * per_node
    assert sorted((r["rank"], r["node"]) for r in found) == list(enumerate(nodes))
    assert {r["world_size"] for r in found} == {world}
    if grouped:
        assert {r["sum"] for r in found} == {world * (world + 1) // 2}
    assert {Path(r["ddpkit"]).resolve().parent for r in found} == {SRC}


@pytest.fixture
def cluster(slurm: SlurmCluster) -> SlurmCluster:
    if not slurm.netns:
        pytest.skip("needs nodes in their own network namespaces to hold a port on one node")
    return slurm


def test_without_reservation_a_step_whose_derived_ports_are_taken_still_starts(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    out = tmp_path / "job.out"
    script = (
        "#!/bin/bash\n"
        f"#SBATCH --nodes=2 --nodelist={NODES} --ntasks-per-node=1 --hold --output={out} --time=5\n"
        f"srun --resv-ports=0 {sys.executable} -u {PAYLOAD}\n"
    )
    job = cluster.sbatch(script, cwd=tmp_path)
    ports = candidate_ports(job, "0")
    text = run_with_first_two_taken(cluster, job, ports, out)
    found = reports(text)
    check_ranks(found, per_node=1)
    assert {(r["master_port"], r["resv_ports"]) for r in found} == {(ports[2], None)}, text


def run_with_first_two_taken(
    cluster: SlurmCluster, job: str, ports: tuple[int, ...], out: Path
) -> str:
    """Release the held ``job`` while its first two candidate ports are taken on its first
    node (a plain listener, then a foreign store); its output once it has COMPLETED."""
    with ExitStack() as stack:
        stack.enter_context(squat(cluster, FIRST_NODE, ports[0], "plain"))
        stack.enter_context(squat(cluster, FIRST_NODE, ports[1], "store"))
        cluster.run("scontrol", "release", job)
        state = cluster.wait(job, timeout_s=JOB_TIMEOUT_S)
    text = out.read_text()
    assert state == "COMPLETED", text
    return text


def ddpkit(env: dict[str, str], cwd: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_the_generated_script_uses_the_port_slurm_reserved(
    cluster: SlurmCluster, tmp_path: Path, launch: str
) -> None:
    spec = tmp_path / "job.yaml"
    payload, per_node = (PAYLOAD, 1) if launch == "srun" else (AGENTS_ONLY, 2)
    spec.write_text(
        f"command: {payload}\nname: ports\nnodes: 2\nprocs_per_node: {per_node}\n"
        f"launch: {launch}\n"
        f"time_min: 5\nsbatch: {{hold: true, nodelist: '{NODES}'}}\n"
        + ("rdzv_port: auto\n" if launch == "torchrun" else "")
    )
    env = {**cluster.env, "DDPKIT_HOME": str(tmp_path / "home")}
    job = cluster.track(ddpkit(env, tmp_path, "submit", str(spec)).strip())
    derived = candidate_ports(job, "0" if launch == "srun" else RDZV_STEP)[0]
    with squat(cluster, FIRST_NODE, derived, "plain"):
        cluster.run("scontrol", "release", job)
        state = cluster.wait(job, timeout_s=JOB_TIMEOUT_S)
    logs = ddpkit(env, tmp_path, "logs", job)
    assert state == "COMPLETED", logs
    found = reports(logs)
    check_ranks(found, per_node, grouped=launch == "srun")
    # --resv-ports=1: one port (SLURM's own default would be a range), the same on every rank,
    # and that is where the ranks (srun) or the agents (torchrun) met.
    reserved = {r["resv_ports"] for r in found}
    assert len(reserved) == 1 and None not in reserved, logs
    (port,) = reserved
    assert port.isdigit() and 12000 <= int(port) <= 12999, logs
    if launch == "srun":
        assert {r["master_port"] for r in found} == {int(port)}, logs
    else:
        met = f"c10d rendezvous at n1:{port} (the port SLURM reserved for the step)"
        assert logs.count(met) == 2, logs  # one line from each node's agent


def test_without_reservation_torchrun_agents_meet_past_taken_ports(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    out = tmp_path / "job.out"
    run = f"{sys.executable} -u -m ddpkit run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d"
    script = (
        "#!/bin/bash\n"
        f"#SBATCH --nodes=2 --nodelist={NODES} --hold --output={out} --time=5\n"
        f'endpoint="$({sys.executable} -m ddpkit.cluster.rendezvous.endpoint)"\n'
        f"srun --resv-ports=0 --ntasks-per-node=1 {run} --rdzv-endpoint $endpoint "
        f"--rdzv-id $SLURM_JOB_ID {AGENTS_ONLY}\n"
    )
    job = cluster.sbatch(script, cwd=tmp_path)
    ports = candidate_ports(job, RDZV_STEP)
    text = run_with_first_two_taken(cluster, job, ports, out)
    check_ranks(reports(text), per_node=2, grouped=False)
    met = f"c10d rendezvous at n1:{ports[2]} ({ports[0]}, {ports[1]} taken)"
    assert text.count(met) == 2, text


def _first_json(text: str) -> dict[str, Any]:
    """The JSON object ``text`` starts with; what follows it on the line is left (under load a
    peer's tee'd output can land on the same line of the shared node log)."""
    found, _ = json.JSONDecoder().raw_decode(text)
    return dict(found)
