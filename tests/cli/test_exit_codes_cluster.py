"""Exit code 4 on the real cluster: sbatch refusing a job is a scheduler failure, not bad input
(marker ``slurm``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_exit_codes import _one_error_line
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm


def test_sbatch_refusing_the_job_exits_4_with_sbatchs_message(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: refused\ncommand: /bin/true\ntime_min: 1\npartition: no-such-partition\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "submit", str(spec)],
        env={**slurm.env, "DDPKIT_HOME": str(tmp_path / "home")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    line = _one_error_line(done.stderr)
    assert (done.returncode, done.stdout) == (4, ""), done.stderr
    assert "invalid partition specified: no-such-partition" in line.lower(), line
    assert not (tmp_path / "home").exists()  # no record of a job that does not exist
