"""Every node of the test cluster, end to end through ``ddpkit submit``: 4 nodes x 2 gloo
processes (8 ranks, each node in its own network namespace) run ``examples/train.py``, are
detected as a SLURM job of world size 8, train, checkpoint, get a stop signal (``scancel
--signal=USR2``, as SLURM's warning sends it), requeue, resume from the checkpoint at the same
step on the same 8 ranks, and evaluate with ``ddpkit.gather`` counting every test sample
exactly once (a test set of 1001 rows: 1001 = 8 x 125 + 1, so the sampler pads 7).

2 processes a node, not more: the test suite is CPU-bound on a 2-core machine and each rank's
start (torch's import) is most of a job's CPU, while 4 a node would take no path that 2 a node
do not."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train.py"
NODES, PROCS = 4, 2
TRAIN = "--epochs 2 --train-size 2048 --test-size 1001 --batch-size 16 --checkpoint-every 2"
JOB_TIMEOUT_S = 480  # two runs of 8 processes on 2 shared cores, and the requeue between


def test_four_nodes_of_two_detect_train_gather_stop_requeue_resume(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: scale\npartition: debug\nnodes: {NODES}\nprocs_per_node: {PROCS}\n"
        f"workdir: {tmp_path}\nlog_dir: logs\nlaunch: srun\ntime_min: 10\n"
        "env: {OMP_NUM_THREADS: '1'}\n"
        f"command: {EXAMPLE} {TRAIN} --checkpoint-dir {tmp_path / 'ck'} --step-delay 0.3\n"
    )
    job = slurm.submit_spec(spec, home=tmp_path / "home")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not any((tmp_path / "ck").glob("ckpt-*")):  # training: its first checkpoint
        assert slurm.state(job) not in FINISHED, _logs(tmp_path)
        assert time.monotonic() < deadline, f"no checkpoint in time\n{_logs(tmp_path)}"
        time.sleep(0.5)
    slurm.run("scancel", "--signal=USR2", job)
    state = slurm.wait(job, timeout_s=max(1.0, deadline - time.monotonic()), states=FINISHED)
    logs = _logs(tmp_path)
    assert state == "COMPLETED", logs
    # detection: every run saw a SLURM job of 16 ranks
    assert logs.count(f"ddpkit: slurm, world size {NODES * PROCS}, backend gloo") == 2, logs
    # the stop: every rank stopped after the same step, rank 0 saved it, the job requeued
    saved = re.findall(r"stop signal: saved step (\d+)", logs)
    resumed = re.findall(r"resumed from \S+ at step (\d+)", logs)
    assert len(saved) == 1 and resumed == saved, logs
    runs = slurm.run(
        "sacct", "-j", job, "--duplicates", "-n", "-P", "-X", "-o", "State,NodeList"
    ).stdout.split()
    assert [line.split("|")[0] for line in runs] == ["REQUEUED", "COMPLETED"], runs
    assert {line.split("|")[1] for line in runs} == {"n[1-4]"}, runs
    # the evaluation counted each of the 1001 test rows once over 8 ranks
    assert "eval: 1001 samples (test set has 1001)" in logs, logs
    assert "weights sha256: " in logs, logs


def _logs(workdir: Path) -> str:
    return "\n".join(
        f"==> {path.name}\n{path.read_text(errors='replace')}"
        for path in sorted((workdir / "logs").glob("*"))
        if path.is_file()
    )
