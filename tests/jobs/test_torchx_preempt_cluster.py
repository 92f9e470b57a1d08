"""A torchx job on the real SLURM stops cleanly on its stop signal: the job contract reaches it.

``ddpkit submit --via torchx --scheduler slurm`` of a spec with ``signal: USR1``: torchx writes
its own (heterogeneous) sbatch script, so what reaches the job is the AppDef's environment,
which carries the job contract (``DDPKIT_SIGNAL``, ``DDPKIT_MAX_REQUEUES``). Once the first
checkpoint exists, ``scancel --signal=USR1`` reaches every process of the steps: each node's
``ddpkit run`` passes it on, the workers latched USR1 at ``init()`` (without the contract they
died of it: USR1's default action), the guard agrees on a step, the checkpoint is saved and
the job is requeued; the requeued run resumes and ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.example import run_example
from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train.py"
TRAIN = "--epochs 3 --train-size 4000 --test-size 501 --checkpoint-every 5 --step-delay 0.1"
HASH = re.compile(r"weights sha256: ([0-9a-f]{64})")
STOPPING = "every rank stops after this step"
# said by rank 0 before `scontrol requeue`, which cancels the steps and cuts their output: the
# launcher must have copied it by then (ddpkit.worker.preempt.COPY_GRACE_S)
REQUEUING = "asking SLURM to put the job back in the queue"


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _runs_until_over(slurm: SlurmCluster, job_id: str, timeout_s: float) -> dict[str, list[str]]:
    """sacct's runs of each het component (``<id>+<k>``), oldest first, once the newest run of
    every component has ended (a REQUEUED run is not an end: the job runs again)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = slurm.run(
            "sacct", "-j", job_id, "--duplicates", "-n", "-P", "-X", "-o", "JobID,State"
        ).stdout
        runs: dict[str, list[str]] = {}
        for line in out.splitlines():
            if "|" in line:
                component, state = line.split("|")[:2]
                runs.setdefault(component, []).append(state.split()[0])
        over = runs and all(s[-1] in FINISHED and s[-1] != "REQUEUED" for s in runs.values())
        if over or time.monotonic() > deadline:
            return runs
        time.sleep(1)


def _uninterrupted() -> str:
    """The output of an uninterrupted run of the job's command: 2 ranks forked from the fork
    server of :mod:`tests.support.distutil` (torch imported once, a real gloo group), which end
    with bitwise the weights of ranks a launcher starts (tests/worker/test_resume.py resumes
    such runs): no launcher is under test here."""
    text = run_example(2, TRAIN.split(), timeout_s=300)
    assert len(HASH.findall(text)) == 1, f"uninterrupted:\n{text}"
    return text


def test_torchx_job_on_slurm_stops_checkpoints_and_requeues(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    if not slurm.accounting:
        pytest.fail("this test reads the job's runs from sacct: start ci/slurm-up with accounting")
    reference = _uninterrupted()
    ck = tmp_path / "ck"
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: txstop\npartition: debug\nnodes: 2\nprocs_per_node: 1\nworkdir: {tmp_path}\n"
        f"env: {{OMP_NUM_THREADS: '1'}}\nsignal: USR1\ntime_min: 5\n"
        f"command: {EXAMPLE} {TRAIN} --checkpoint-dir {ck}\n"
    )
    env = {**slurm.env, "DDPKIT_HOME": str(tmp_path / "home")}
    submit = [sys.executable, "-m", "ddpkit", "submit", str(spec), "--via", "torchx"]
    handle = _run([*submit, "--scheduler", "slurm"], env, tmp_path).strip()
    match = re.fullmatch(r"slurm://torchx/(\d+)", handle)
    assert match is not None, handle
    job_id = slurm.track(match.group(1))
    deadline = time.monotonic() + 300
    while not any(ck.glob("ckpt-*.pt")):
        assert time.monotonic() < deadline, "no checkpoint appeared in time"
        assert slurm.state(job_id) not in FINISHED, f"job {job_id} ended before its checkpoint"
        time.sleep(0.2)
    slurm.run("scancel", "--signal=USR1", job_id)
    runs = _runs_until_over(slurm, job_id, timeout_s=480)
    logs = "".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("slurm-*")))
    where = f"job {job_id}; runs per het component {runs}; logs:\n{logs[-6000:]}"
    assert STOPPING in logs, where
    assert REQUEUING in logs, where
    for component, states in runs.items():  # each of the 2 het components: requeued, then done
        assert "REQUEUED" in states[:-1] and states[-1] == "COMPLETED", f"{component}: {where}"
    assert re.search(rf"resumed from {re.escape(str(ck))} at step \d+", logs), where
    assert HASH.findall(logs)[-1:] == HASH.findall(reference), where
