"""The jobs CLI against the real SLURM cluster of ``ci/slurm-up`` (2 nodes; marker ``slurm``).

The jobs run tests/scripts/report_rank.py, which joins the job with ``ddpkit.init()``, does a
gloo all_reduce and prints one JSON line per rank; those that judge only where each rank runs
or that a cancel ends every process run its torch-free twin, tests/scripts/report_rank_env.py
(the same line without the group: a rank costs a Python start, not an ``import torch``), while
a real group still forms under each launcher: ``submitit``'s ranks job, two jobs at once (srun)
and the host template's (torchrun). ``ddpkit`` runs as a subprocess (as users run
it) with the cluster's environment and a private DDPKIT_HOME; output is read back through the
jobs API from the same records. Jobs are small (the machine has 2 cores) and the fixture cancels
whatever a test leaves behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpkit.jobs import api
from ddpkit.jobs.load import load_spec
from ddpkit.jobs.records import load_record
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = ROOT / "tests" / "scripts" / "report_rank.py"
RANKS_ONLY = ROOT / "tests" / "scripts" / "report_rank_env.py"  # torch-free, no group
JOB_TIMEOUT_S = 90
LAUNCHER = {"srun": "slurm", "torchrun": "torchrun", "submitit": "submitit"}


class Jobs:
    """``ddpkit`` on the test cluster, from a work directory with its own DDPKIT_HOME."""

    def __init__(self, slurm: SlurmCluster, workdir: Path) -> None:
        self.slurm = slurm
        self.workdir = workdir
        self.env = {**slurm.env, "DDPKIT_HOME": str(workdir / "home")}

    def spec(self, fields: str, args: str = "", payload: Path = PAYLOAD) -> Path:
        """A spec file running ``payload`` with ``args``, plus ``fields`` (YAML lines)."""
        path = self.workdir / "job.yaml"
        path.write_text(f"command: {payload} {args}\ntime_min: 5\n{fields}")
        return path

    def ddpkit(self, *args: str, timeout_s: float = 60) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "ddpkit", *args],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        assert done.returncode == 0, f"ddpkit {' '.join(args)}: {done.stderr}"
        return done.stdout

    def submit(self, spec: Path, *flags: str) -> str:
        out = self.ddpkit("submit", str(spec), *flags)
        assert re.fullmatch(r"\d+\n", out), f"stdout is not only the job id: {out!r}"
        return self.slurm.track(out.strip())


@pytest.fixture
def jobs(slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Jobs:
    # the in-process API (reading logs back) sees the same records and cluster as the CLI
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    return Jobs(slurm, tmp_path)


RANKS = [("sbatch", "srun"), ("sbatch", "torchrun"), ("submitit", "srun")]
# which rank runs where is plumbing: torch-free, but for one job whose 4 ranks also form their
# group (srun's and torchrun's groups form in the tests of two jobs at once and of host_template)
GROUPED = ("submitit", "srun")
IB = "ib"
IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@pytest.fixture(scope="module")
def early(
    slurm_cluster: SlurmCluster,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[dict[str, tuple[Jobs, str]]]:
    """The jobs of the tests that only watch a job run to its end (each rank test's, the host
    template's), submitted together before the first of them: each test then follows its own
    job, which ran meanwhile, instead of starting it after the one before had ended. Only the
    selected tests' jobs; each with its own folder and DDPKIT_HOME; cancelled at the end."""
    slurm = SlurmCluster(slurm_cluster.env, slurm_cluster.info)  # its own list of jobs to cancel
    selected = {item.nodeid.partition("::")[2] for item in request.session.items}
    submitted: dict[str, tuple[Jobs, str]] = {}
    try:
        ranks = test_two_nodes_two_processes_every_rank_where_slurm_put_it.__name__
        for via, launch in RANKS:
            if f"{ranks}[{via}-{launch}]" in selected:
                jobs = Jobs(slurm, tmp_path_factory.mktemp(f"ranks-{via}-{launch}"))
                fields = f"name: ranks\nnodes: 2\nprocs_per_node: 2\nlaunch: {launch}\n"
                spec = jobs.spec(
                    f"{fields}rdzv_port: auto\n",
                    payload=PAYLOAD if (via, launch) == GROUPED else RANKS_ONLY,
                )
                submitted[f"{via}-{launch}"] = (jobs, jobs.submit(spec, "--via", via))
        ib = test_torchrun_with_a_host_template_rendezvous_on_the_first_nodes_fast_name.__name__
        if ib in selected and slurm.netns and slurm.info.get("node_ib_addrs"):
            jobs = Jobs(slurm, tmp_path_factory.mktemp(IB))
            fields = 'name: ib\nnodes: 2\nlaunch: torchrun\nhost_template: "{host}-ib"\n'
            spec = jobs.spec(fields, "--env GLOO_SOCKET_IFNAME --env NCCL_SOCKET_IFNAME")
            submitted[IB] = (jobs, jobs.submit(spec))
        yield submitted
    finally:
        slurm.cancel_tracked()


def submitted_early(
    early: dict[str, tuple[Jobs, str]], key: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Jobs, str]:
    """A job ``early`` submitted, with the in-process API pointed at its records."""
    jobs, job = early[key]
    monkeypatch.setenv("DDPKIT_HOME", jobs.env["DDPKIT_HOME"])
    monkeypatch.setenv("SLURM_CONF", jobs.slurm.env["SLURM_CONF"])
    return jobs, job


def reports(text: str) -> list[dict[str, Any]]:
    """The JSON lines report_rank.py printed (torchrun's "[rankN]: " prefix removed)."""
    found = []
    for line in text.splitlines():
        start = line.find('{"rank"')
        if start >= 0:
            found.append(json.loads(line[start:]))
    return found


def placement(slurm: SlurmCluster, job_id: str) -> list[str]:
    """The job's nodes in SLURM's order, from SLURM itself (scontrol show job / hostnames)."""
    shown = slurm.run("scontrol", "show", "job", "--oneliner", job_id).stdout
    nodelist = re.search(r"(?:^|\s)NodeList=(\S+)", shown)
    assert nodelist is not None, shown
    return slurm.run("scontrol", "show", "hostnames", nodelist.group(1)).stdout.split()


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"still not {what} after {timeout_s} s")
        time.sleep(0.2)


@pytest.mark.parametrize(("via", "launch"), RANKS)
def test_two_nodes_two_processes_every_rank_where_slurm_put_it(
    slurm: SlurmCluster,
    early: dict[str, tuple[Jobs, str]],
    monkeypatch: pytest.MonkeyPatch,
    via: str,
    launch: str,
) -> None:
    jobs, job = submitted_early(early, f"{via}-{launch}", monkeypatch)
    followed = jobs.ddpkit("logs", job, "--follow", timeout_s=JOB_TIMEOUT_S)
    assert jobs.ddpkit("status", job) == f"COMPLETED (exit code 0)\nrun slurm-{job} attempt 0\n"

    nodes = placement(jobs.slurm, job)
    assert len(nodes) == 2
    expected = [
        {
            "rank": rank,
            "local_rank": rank % 2,
            "world_size": 4,
            "node": nodes[rank // 2],  # block distribution: ranks 0,1 on the first node
            "launcher": LAUNCHER["submitit" if via == "submitit" else launch],
            **({"sum": 1 + 2 + 3 + 4} if (via, launch) == GROUPED else {}),
        }
        for rank in range(4)
    ]
    strip = [{k: v for k, v in r.items() if k != "master_port"} for r in reports(followed)]
    assert sorted(strip, key=lambda r: r["rank"]) == expected
    for rank in range(4):  # each rank's own output (file, or filtered node file) is its own
        text = api.read_logs(job, rank).text
        assert [r["rank"] for r in reports(text)] == [rank], text
    record = load_record(job)
    assert record is not None and record.via == via


def test_two_multi_node_jobs_at_once_on_the_same_nodes(jobs: Jobs) -> None:
    # 2 nodes x 1 process each: both fit at once even on 2-CPU nodes; each holds its process
    # group (and rank 0 its port) until the test saw both jobs' ranks report (the file
    # `release`), so a shared port would fail one of them. (A fixed 4-s hold was not enough:
    # under load one job had ended before the other started, 2026-12-02.)
    # Both are pinned to the same two nodes: left to SLURM, a job of another test running at
    # the time can send them to different pairs (seen in CI: n3,n4 and n1,n2); two of the
    # default partition's, where the jobs go (not those of partition badnet, if any)
    listed = jobs.slurm.run("sinfo", "--noheader", "--partition", "debug", "--format", "%n")
    names = listed.stdout.split()
    pair = ",".join(sorted(set(names))[:2])
    release = jobs.workdir / "release"
    spec = jobs.spec(
        f"name: pair\nnodes: 2\nsbatch:\n  nodelist: {pair}\n",
        args=f"--sleep {JOB_TIMEOUT_S} --until {release}",
    )
    first, second = jobs.submit(spec), jobs.submit(spec)

    def both_reported() -> bool:
        return all(len(reports(api.read_logs(job).text)) == 2 for job in (first, second))

    # a job's start, not a fixed window: the bound of a whole job
    eventually(both_reported, "both reported, holding their groups", timeout_s=JOB_TIMEOUT_S)
    release.touch()
    found = {}
    for job in (first, second):
        assert api.wait(job, timeout_s=JOB_TIMEOUT_S, poll_s=0.5).exit_code == 0
        assert str(api.status(job).state.name) == "COMPLETED"
        found[job] = reports(api.read_logs(job).text)
        assert [r["sum"] for r in found[job]] == [3, 3]
        assert {r["node"] for r in found[job]} == set(placement(jobs.slurm, job))
    assert set(placement(jobs.slurm, first)) == set(placement(jobs.slurm, second))
    assert ",".join(sorted(placement(jobs.slurm, first))) == pair
    ports = {job: {r["master_port"] for r in rows} for job, rows in found.items()}
    assert len(ports[first]) == len(ports[second]) == 1
    assert ports[first] != ports[second]


def test_srun_spec_run_without_srun_is_caught_with_a_hint(jobs: Jobs) -> None:
    # the check is detect()'s, which ddpkit.init() runs first: the torch-free payload has it too
    spec = jobs.spec("name: nosrun\nnodes: 2\nprocs_per_node: 2\n", payload=RANKS_ONLY)
    script = jobs.ddpkit("submit", str(spec), "--dry-run")
    # the hand-edited script: srun dropped, python started by the batch script itself
    edited, count = re.subn(r"(?m)^srun .*?--output=\S+ ", "", script)
    assert count == 1, script
    log_dir = Path(load_spec(spec, cwd=jobs.workdir).log_path)
    log_dir.mkdir()  # SLURM opens the batch output before the script runs
    job = jobs.slurm.sbatch(edited, cwd=jobs.workdir)
    assert jobs.slurm.wait(job, timeout_s=JOB_TIMEOUT_S) == "FAILED"
    text = (log_dir / f"nosrun-{job}.out").read_text()
    assert "TopologyError: DDPKIT_EXPECTED_WORLD_SIZE=4" in text
    assert "start the tasks with srun" in text
    assert reports(text) == []  # no process went on alone as rank 0 of 1


# report_rank_env.py's line, then sleep argv[1] seconds (what a cancel ends is processes, not a
# group: no torch needed)
SLEEPER = """import runpy, sys, time
runpy.run_path({payload!r}, run_name="__main__")
time.sleep(float(sys.argv[1]))
"""


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_cancel_ends_every_process_of_the_job(jobs: Jobs, launch: str) -> None:
    marker = f"ddpkit-cancel-{uuid.uuid4().hex}"
    sleeper = jobs.workdir / "sleeper.py"  # torch-free: reports its rank, then sleeps
    sleeper.write_text(SLEEPER.format(payload=str(RANKS_ONLY)))
    spec = jobs.spec(
        f"name: victim\nnodes: 2\nlaunch: {launch}\nrdzv_port: auto\n",
        args=f"300 {marker}",
        payload=sleeper,
    )
    job = jobs.submit(spec)
    eventually(lambda: len(reports(api.read_logs(job).text)) == 2, "reporting", JOB_TIMEOUT_S)
    assert len(jobs.slurm.processes(marker)) >= 2  # a worker per node (and launchers)
    jobs.ddpkit("cancel", job)
    jobs.slurm.wait(job, timeout_s=30)
    eventually(lambda: not jobs.slurm.processes(marker), "all gone", timeout_s=20)
    assert jobs.ddpkit("status", job).startswith("CANCELLED")


def test_submit_function_runs_in_every_task_with_the_specs_resources(jobs: Jobs) -> None:
    spec = load_spec(jobs.spec("name: fn\nnodes: 2\n"), cwd=jobs.workdir)
    # a function importable on the nodes (a test module's would not be): each task's node name
    job = api.submit_function(os.getenv, "SLURMD_NODENAME", spec=spec)
    jobs.slurm.track(str(job.job_id))
    results = job.results()
    assert sorted(results) == sorted(placement(jobs.slurm, str(job.job_id)))
    record = load_record(str(job.job_id))
    assert record is not None and (record.via, record.nodes) == ("submitit", 2)


def test_torchrun_with_a_host_template_rendezvous_on_the_first_nodes_fast_name(
    slurm: SlurmCluster, early: dict[str, tuple[Jobs, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # n<i>-ib is a second address of node n<i> (ci/slurm-up): no name or address `hostname`
    # gives, so torch's own guess of who hosts the c10d store (endpoint host == this machine?)
    # finds no host, and every node waited as a client until the join failed. No rdzv_port
    # either: a multi-node torchrun job takes the job-derived port by default.
    if not slurm.netns:
        pytest.skip("the cluster runs without NETNS=1, so without nI-ib addresses")
    assert slurm.info.get("node_ib_addrs"), "cluster predates nI-ib: rerun ci/slurm-up"
    jobs, job = submitted_early(early, IB, monkeypatch)  # its spec: `early`
    followed = jobs.ddpkit("logs", job, "--follow", timeout_s=JOB_TIMEOUT_S)
    shown = jobs.ddpkit("status", job)
    assert shown == f"COMPLETED (exit code 0)\nrun slurm-{job} attempt 0\n", followed
    nodes = placement(jobs.slurm, job)
    batch = api.read_logs(job).text
    assert f"ddpkit: c10d rendezvous endpoint {nodes[0]}-ib:" in batch, batch
    rows = sorted(reports(followed), key=lambda r: r["rank"])
    # node ranks follow the order the nodes joined in: which node got rank 0 is not fixed
    expected = [(rank, "torchrun", 3) for rank in range(2)]
    assert [(r["rank"], r["launcher"], r["sum"]) for r in rows] == expected
    assert sorted(r["node"] for r in rows) == sorted(nodes)
    # each node's agent named the interface of its route to nI-ib, eth0 in each node's
    # namespace, for gloo and NCCL (ddpkit.launch.local.ifname_env): neither was set by the job
    assert [r["env"] for r in rows] == [dict.fromkeys(IFNAMES, "eth0")] * 2, rows
