"""Rendered sbatch scripts on the real test cluster (``ci/slurm-up``): few, small jobs.

What only a real SLURM can judge: sbatch's own parsing of the ``#SBATCH`` lines, srun's file
name patterns, and the ranks SLURM hands out; plus the batch-script-without-srun case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpkit.jobs import render
from ddpkit.jobs.spec import JobSpec
from tests.jobs.test_render import EVIL, spec
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

REPORT = """import os, sys, ddpkit
info = ddpkit.detect()
print("procid", os.environ["SLURM_PROCID"], "rank", info.rank, "world", info.world_size,
      "local", info.local_rank, "node", info.node_rank, "args", repr(sys.argv[1:]))
"""
# A user template that runs the command in the batch script itself, without srun.
NO_SRUN = """#!/bin/bash
{% for key, value in sbatch_options %}
#SBATCH --{{ key }}{{ "" if value is none else "=" ~ value | sbatch_q }}
{% endfor %}
cd -- {{ workdir | q }}
{% for key, value in exports %}
export {{ key }}={{ value | q }}
{% endfor %}
{{ python | q }} -u {{ command | map("q") | join(" ") }}
"""


def submit(slurm: SlurmCluster, job: JobSpec) -> tuple[str, str]:
    """Submit the rendered script as ``ddpkit submit`` would; (job id, final state)."""
    Path(job.log_path).mkdir(parents=True, exist_ok=True)  # SLURM opens the batch output first
    submitted = slurm.run("sbatch", "--parsable", stdin=render.render_sbatch(job))
    job_id = slurm.track(submitted.stdout.strip().split(";")[0])
    return job_id, slurm.wait(job_id, timeout_s=120)


def test_srun_mode_2x2(slurm: SlurmCluster, tmp_path: Path) -> None:
    workdir = tmp_path / "job dir it's 50% ünï"
    workdir.mkdir()
    (workdir / "report.py").write_text(REPORT)
    arg = "it's $(touch pwned) ; %j"
    job = spec(
        name="render-2x2",
        command=["report.py", arg],
        python=sys.executable,
        workdir=str(workdir),
        log_dir="logs $x",
        nodes=2,
        procs_per_node=2,
        time_min=2,
    )
    job_id, state = submit(slurm, job)
    batch = Path(render.batch_output_path(job, job_id))
    assert state == "COMPLETED", batch.read_text() if batch.exists() else state
    for rank in range(4):
        out = Path(job.log_path, f"render-2x2-{job_id}-rank{rank}.out").read_text()
        assert out.split()[:10] == [
            *("procid", str(rank), "rank", str(rank), "world", "4"),
            *("local", str(rank % 2), "node", str(rank // 2)),
        ], out
        assert out.strip().endswith(f"args {[arg]!r}")
    assert not list(tmp_path.rglob("pwned"))


def test_batch_script_without_srun_fails_with_the_hint(slurm: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "report.py").write_text(REPORT)
    (tmp_path / "no-srun.sh.j2").write_text(NO_SRUN)
    job = spec(
        name="no-srun",
        command=["report.py"],
        python=sys.executable,
        workdir=str(tmp_path),
        template="no-srun.sh.j2",
        signal=None,  # a template that does not extend ddpkit's is refused with a stop signal
        nodes=2,
        procs_per_node=2,
        time_min=2,
    )
    job_id, state = submit(slurm, job)
    out = Path(render.batch_output_path(job, job_id)).read_text()
    assert state == "FAILED", out
    assert "TopologyError: DDPKIT_EXPECTED_WORLD_SIZE=4" in out
    assert "start the tasks with srun (the generated script does)" in out


def test_sbatch_reads_hostile_directives_back_exactly(slurm: SlurmCluster, tmp_path: Path) -> None:
    workdir = tmp_path / 'wd it\'s "q" #x ünï'
    workdir.mkdir()
    job = spec(name="held", workdir=str(workdir), sbatch={"comment": EVIL, "hold": True})
    submitted = slurm.run("sbatch", "--parsable", stdin=render.render_sbatch(job))
    job_id = slurm.track(submitted.stdout.strip().split(";")[0])
    shown = slurm.run("squeue", "-h", "-j", job_id, "-o", "%j\t%Z\t%k").stdout
    assert shown.rstrip("\n").split("\t") == ["held", str(workdir), EVIL]


def test_a_user_template_with_allowed_blocks_runs(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A user template (tests/jobs/test_user_template.py's ALLOWED: an #SBATCH line, shell lines
    before and after the step, an srun option, a wrapper around the command) extends ddpkit's
    base: sbatch takes it, and the job runs with the stop-signal protocol in place."""
    from tests.jobs.test_user_template import ALLOWED

    (tmp_path / "report.py").write_text(REPORT)
    (tmp_path / "site.sh.j2").write_text(ALLOWED)
    job = spec(
        name="user-template",
        command=["report.py"],
        python=sys.executable,
        workdir=str(tmp_path),
        template="site.sh.j2",
        nodes=2,
        procs_per_node=1,
        time_min=2,
    )
    script = render.render_sbatch(job)
    assert "#SBATCH --comment=site-template" in script and "-m ddpkit.cluster.stop.hold" in script
    job_id, state = submit(slurm, job)
    batch = Path(render.batch_output_path(job, job_id)).read_text()
    assert state == "COMPLETED", batch
    assert "site: before the step" in batch and "site: after the step" in batch, batch
    for rank in range(2):
        out = Path(job.log_path, f"user-template-{job_id}-rank{rank}.out").read_text()
        assert f"{rank}: procid {rank} rank {rank} world 2" in out, out  # srun --label
