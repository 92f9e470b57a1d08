"""``cpu_bind`` on the real test cluster's node nc1 (partition ``bind``; ``ci/slurm-up`` gives it
the machine's own topology, 2 CPUs: Sockets=1 CoresPerSocket=2 ThreadsPerCore=1, and runs
``TaskPlugin=task/affinity``, so srun binds there): under ``map_cpu:1,0`` and
``mask_cpu:0x1,0x2`` each rank's CPUs, as the rank reads them (``os.sched_getaffinity``), are
the ones ``ddpkit plan`` printed for its local rank (read from plan's output, not recomputed);
under ``cores``, where plan says srun picks, each rank has the one CPU plan says a task gets on
a node of one thread per core, and no two ranks the same. One job per value (1 node x 2 tasks,
``launch: srun``), submitted together and waited on together: the partition's one node runs
them one after another, a few seconds each.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.needs import missing
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

PARTITION = "bind"
GUARD_S = 150  # a hang guard for the three jobs, one after another on nc1; not a timing assertion
VALUES = {"map": "map_cpu:1,0", "mask": "mask_cpu:0x1,0x2", "cores": "cores"}
# each rank: its SLURM_LOCALID and the CPUs it may run on, in a file of its own
PAYLOAD = """\
import json, os, pathlib, sys
got = {"local": int(os.environ["SLURM_LOCALID"]), "cpus": sorted(os.sched_getaffinity(0))}
(pathlib.Path(sys.argv[1]) / f"rank{os.environ['SLURM_PROCID']}.json").write_text(json.dumps(got))
"""
SPEC = """\
name: bind-{key}
command: {payload} {folder}
python: {python}
partition: {partition}
nodes: 1
procs_per_node: 2
cpus_per_task: 1
cpus_per_node: 2
cpu_bind: '{value}'
launch: srun
time_min: 3
max_requeues: 0
workdir: {folder}
log_dir: logs
"""
_SPAN = r"\d+(?:-\d+)?"
_ITEM = re.compile(rf"local ranks? (\d+)(?:-(\d+) (each|in order))? -> ({_SPAN}(?:,{_SPAN})*)")


def _cpus(text: str) -> set[int]:
    """A CPU list as plan writes it (``0-3,8``)."""
    found: set[int] = set()
    for span in text.split(","):
        first, _, last = span.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


def planned(line: str) -> dict[int, set[int]]:
    """Each local rank's CPUs from plan's ``# cpus on each node:`` line (its three forms: one
    rank, a run of ranks with the same CPUs, a run in order; checked against plan itself in
    ``test_bind_cpus.py``)."""
    ranks: dict[int, set[int]] = {}
    for first, last, how, cpus in _ITEM.findall(line):
        span = range(int(first), int(last or first) + 1)
        ordered = sorted(_cpus(cpus))
        for i, rank in enumerate(span):
            ranks[rank] = {ordered[i]} if how == "in order" else _cpus(cpus)
    return ranks


def _plan(slurm: SlurmCluster, spec: Path, home: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "plan", str(spec)],
        env={**slurm.env, "DDPKIT_HOME": str(home)}, cwd=spec.parent,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("# cpus on each node:")]
    assert len(lines) == 1, done.stdout
    return lines[0]


def _ranks(folder: Path) -> dict[int, set[int]]:
    """What each rank of a job read: local rank -> its CPUs."""
    got = [json.loads(path.read_text()) for path in sorted(folder.glob("rank*.json"))]
    return {report["local"]: set(report["cpus"]) for report in got}


def _logs(folder: Path) -> str:
    return "\n".join(
        f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}"
        for path in sorted((folder / "logs").glob("*"))
        if path.is_file()
    )


def test_each_rank_runs_on_the_cpus_plan_printed(slurm: SlurmCluster, tmp_path: Path) -> None:
    nodes = slurm.run("sinfo", "-h", "-p", PARTITION, "-o", "%N", check=False).stdout.strip()
    if not nodes:
        missing(
            f"the test cluster has no partition {PARTITION} (node nc1, the machine's own CPUs, "
            "TaskPlugin=task/affinity): ci/slurm-up sets it up"
        )
    payload = tmp_path / "payload.py"
    payload.write_text(PAYLOAD)
    home = tmp_path / "home"
    plans, jobs = {}, {}
    for key, value in VALUES.items():
        folder = tmp_path / key
        folder.mkdir()
        spec = folder / "job.yaml"
        fields = {"payload": payload, "folder": folder, "python": sys.executable}
        spec.write_text(SPEC.format(key=key, partition=PARTITION, value=value, **fields))
        plans[key] = _plan(slurm, spec, home)
        jobs[key] = slurm.submit_spec(spec, home=home)
    states = {key: slurm.wait(job, GUARD_S) for key, job in jobs.items()}
    for key, state in states.items():
        logs = _logs(tmp_path / key)
        assert state == "COMPLETED", f"{VALUES[key]} on {nodes}: {state}\n{logs}"
    got = {key: _ranks(tmp_path / key) for key in VALUES}
    why = "nc1's TaskPlugin must bind (task/affinity)"

    for key in ("map", "mask"):
        expected = planned(plans[key])
        assert sorted(expected) == [0, 1], plans[key]
        assert got[key] == expected, f"{VALUES[key]}: plan said {plans[key]!r}; {why}"

    # cores: srun picks; plan says how many CPUs a task gets where a core has one thread (nc1)
    assert "srun's choice" in plans["cores"], plans["cores"]
    count = re.search(r"\((\d+) CPUs? where a core has one thread\)", plans["cores"])
    assert count is not None and int(count.group(1)) == 1, plans["cores"]
    cores = got["cores"]
    assert sorted(cores) == [0, 1], cores
    assert all(len(cpus) == 1 for cpus in cores.values()), f"cores: {cores}; {why}"
    assert cores[0] != cores[1], f"cores: both ranks on {cores[0]}"
