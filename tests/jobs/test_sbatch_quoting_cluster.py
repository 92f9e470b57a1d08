"""Hostile ``#SBATCH`` values on the real cluster: they reach SLURM intact, and add nothing.

Through submitit, a value with ``\\'`` used to end submitit's (bash) quoting for sbatch's own
parser and add an option of its own: here an ``--export`` putting a variable into the job's
environment. The job prints that variable; SLURM's view of the comment must be the value.
Held jobs (``sbatch: {hold: true}``) check more values without running anything.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpkit.jobs import api
from ddpkit.jobs.records import Via
from ddpkit.jobs.spec import JobSpec
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

INJECTION = "a\\'\" --export=ALL,DDPKIT_INJECTED=pwned #"
PRINT_ENV = "import os; print('INJECTED=' + os.environ.get('DDPKIT_INJECTED', '<unset>'))"
HELD_VALUES = [
    INJECTION,
    "x\\' --hold '",
    "back\\slash and trailing\\",
    'it\'s "quoted" #not a comment',
    "$(id); `id`",
    "x hetjob y",
    "ünïcödé\ttab",
]


@pytest.fixture
def cluster_env(slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The in-process jobs API talks to the test cluster, with a private DDPKIT_HOME."""
    for key in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(key, slurm.env[key])
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    return tmp_path


def comment(slurm: SlurmCluster, job_id: str) -> str:
    """The job's comment as SLURM holds it (an ended job too, within MinJobAge)."""
    return slurm.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%k").stdout[:-1]


def test_submitit_value_cannot_add_an_sbatch_option(slurm: SlurmCluster, cluster_env: Path) -> None:
    (cluster_env / "env.py").write_text(PRINT_ENV + "\n")
    spec = JobSpec(
        name="inject",
        command=["env.py"],
        python=sys.executable,
        time_min=3,
        workdir=str(cluster_env),
        sbatch={"comment": INJECTION},
    )
    job = slurm.track(api.submit(spec, "submitit").job_id)
    assert slurm.wait(job, timeout_s=120) == "COMPLETED"
    log = (Path(spec.log_path) / f"{job}_0_log.out").read_text()
    assert "INJECTED=<unset>" in log, log
    assert comment(slurm, job) == INJECTION


@pytest.mark.parametrize("via", ["sbatch", "submitit"])
def test_held_jobs_carry_hostile_comments_intact(
    slurm: SlurmCluster, cluster_env: Path, via: Via
) -> None:
    for value in HELD_VALUES:
        spec = JobSpec(
            name="held",
            command=["env.py"],
            time_min=3,
            workdir=str(cluster_env),
            sbatch={"comment": value, "hold": True},
        )
        job = slurm.track(api.submit(spec, via).job_id)
        try:
            assert comment(slurm, job) == value
            shown = slurm.run("scontrol", "show", "job", job).stdout
            assert "Reason=JobHeldUser" in shown, shown  # held by our option, nothing else
        finally:
            slurm.run("scancel", job, check=False)
