"""A sweep on the real SLURM cluster: one array of four 2-node runs of a torch-free stub.

One 2 x 2 sweep (lr x seed), each task 2 nodes x 1 process with 1 CPU, so all four fit the
2 x 4 CPUs at once. Each runs tests/scripts/sweep_stop.py: ddpkit's torch-free stop path (the
job contract's latch, its rank from ``detect()``, the requeue plan and ``scontrol requeue``) in
steps, with text files for checkpoints; what is judged is the sweep's plumbing, which needs no
torch (resuming training exactly after a requeue: tests/launch/test_preempt_cluster.py). The
module fixture submits it with ``ddpkit submit --sweep`` and drives it by synchronisation
points, not timers:

* once task 1 has written its first checkpoint: ``scancel --signal=USR2 JOB_1`` (what SLURM's
  warning does): task 1 alone must be requeued and resume from its checkpoint;
* once task 2 has written its first checkpoint: ``ddpkit cancel JOB_2``: only task 2 stops;
* tasks 0 and 3 run once, to the end.

Then each assertion reads what it needs: sacct's runs of every task, the tasks' own output (each
ran with its own values), ``ddpkit status JOB`` (one table), ``ddpkit logs JOB_3 --rank 1``.
A sweep with more runs than the cluster's MaxArraySize (1001) is refused with exit 2 and nothing
submitted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = [pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = ROOT / "tests" / "scripts" / "sweep_stop.py"
# 32 steps of at least 0.5 s, the first checkpoint after 2: the signal and the cancel, sent once
# that checkpoint exists, have 15 s before a run could end (with examples/train.py, 0.2 s steps
# and a checkpoint after 4, a cancel under CI's load came after task 2 had printed its weights)
STEPS = "--steps 32 --checkpoint-every 2 --step-delay 0.5"
SWEEP_TIMEOUT_S = 240
RUNS = ["lr=0.1,seed=1", "lr=0.1,seed=2", "lr=0.05,seed=1", "lr=0.05,seed=2"]
RESULT = re.compile(r"result: lr (\S+) seed (\d+) after 32 steps")


@dataclass
class Sweep:
    job: str
    workdir: Path
    env: dict[str, str]
    history: dict[int, list[str]]  # task -> State of each run (sacct --duplicates), oldest first

    def ddpkit(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ddpkit", *args],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def output(self, task: int) -> str:
        """Every file of the task: its batch output and its run folder's rank files."""
        logs = self.workdir / "logs"
        files = [logs / f"sweep-{self.job}_{task}.out", *sorted((logs / RUNS[task]).glob("*"))]
        return "".join(
            f"==> {p.name}\n{p.read_text(errors='replace')}" for p in files if p.exists()
        )


def _history(slurm: SlurmCluster, job: str) -> dict[int, list[str]]:
    out = slurm.run(
        "sacct", "-j", job, "--duplicates", "-n", "-P", "-X", "-o", "JobID,State"
    ).stdout
    runs: dict[int, list[str]] = {}
    for line in out.splitlines():
        task_id, _, state = line.partition("|")
        task = task_id.partition("_")[2]
        if task.isdigit():
            runs.setdefault(int(task), []).append(state.split()[0])
    return runs


@pytest.fixture(scope="module")
def sweep(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    slurm = slurm_cluster
    if not slurm.accounting:
        pytest.fail(
            "these tests read each task's runs from sacct: start ci/slurm-up with accounting"
        )
    workdir = tmp_path_factory.mktemp("sweep")
    env = {**slurm.env, "DDPKIT_HOME": str(workdir / "home")}
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_JOB", "DDPKIT_SWEEP"))}
    (workdir / "job.yaml").write_text(
        f"name: sweep\npartition: debug\nnodes: 2\nprocs_per_node: 1\ncpus_per_task: 1\n"
        f"time_min: 5\nworkdir: {workdir}\nlog_dir: logs\n"
        f"command: {PAYLOAD} {STEPS} --lr {{lr}} --seed {{seed}} "
        f"--checkpoint-dir {workdir}/ck/{{sweep_run}}\n"
    )
    result = Sweep("", workdir, env, {})
    done = result.ddpkit("submit", "job.yaml", "--sweep", "lr=0.1,0.05", "--sweep", "seed=1,2")
    assert done.returncode == 0 and re.fullmatch(r"\d+\n", done.stdout), done.stderr
    result.job = slurm.track(done.stdout.strip())
    try:
        _preempt_one_cancel_another(slurm, result)
        deadline = time.monotonic() + SWEEP_TIMEOUT_S
        for task in range(4):
            remaining = max(1.0, deadline - time.monotonic())
            slurm.wait(f"{result.job}_{task}", timeout_s=remaining, states=FINISHED)
        result.history = _history(slurm, result.job)
        return result
    finally:
        slurm.cancel_tracked()


def _preempt_one_cancel_another(slurm: SlurmCluster, sweep: Sweep) -> None:
    """Signal task 1 and cancel task 2, each once its first checkpoint exists."""
    pending = {2: "cancel", 1: "signal"}  # the cancel first: a subprocess, the slower one
    deadline = time.monotonic() + SWEEP_TIMEOUT_S
    while pending and time.monotonic() < deadline:
        for task, action in list(pending.items()):
            if not any((sweep.workdir / "ck" / RUNS[task]).glob("ckpt-*.pt")):
                continue
            if action == "signal":
                slurm.run("scancel", "--signal=USR2", f"{sweep.job}_{task}")
            else:
                done = sweep.ddpkit("cancel", f"{sweep.job}_{task}")
                assert done.returncode == 0, done.stderr
            del pending[task]
        time.sleep(0.1)
    assert not pending, f"no checkpoint in time for tasks {sorted(pending)}"


def test_every_task_runs_with_its_own_values_in_its_own_folders(sweep: Sweep) -> None:
    for task, run in enumerate(RUNS):
        lr, seed = (part.split("=")[1] for part in run.split(","))
        out = sweep.output(task)
        assert f"ddpkit: sweep task {task} of 4: run {run}" in out, out[-3000:]
        assert f"hyperparameters: lr {float(lr)}, seed {seed}\n" in out, out[-3000:]
        assert "rank 0: slurm, world size 2" in out and "rank 1: slurm, world size 2" in out, out
        assert any((sweep.workdir / "ck" / run).glob("ckpt-*.pt")), f"task {task}: no checkpoint"
        if task != 2:  # ran to its end (2 is cancelled)
            assert RESULT.findall(out) == [(str(float(lr)), seed)], out[-3000:]


def test_a_preempted_task_requeues_and_resumes_alone_while_the_others_finish(sweep: Sweep) -> None:
    where = f"runs {sweep.history}; task 1:\n{sweep.output(1)[-4000:]}"
    assert sweep.history[1][-1] == "COMPLETED", where
    assert "REQUEUED" in sweep.history[1][:-1], where
    assert re.search(rf"requeue {sweep.job}_1 \(1 of 10\): done", sweep.output(1)), where
    assert re.search(r"resumed from \S+ at step [1-9]\d* ", sweep.output(1)), where
    assert sweep.history[0] == ["COMPLETED"] and sweep.history[3] == ["COMPLETED"], where


def test_cancel_of_one_task_stops_only_that_task(sweep: Sweep) -> None:
    assert sweep.history[2] == ["CANCELLED"], sweep.history
    assert not RESULT.search(sweep.output(2)), "the cancelled task ran to its end"


def test_status_is_one_table_and_logs_read_one_task_and_rank(sweep: Sweep) -> None:
    done = sweep.ddpkit("status", sweep.job)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 6, done.stdout
    # task 1, preempted and requeued once, is at attempt 1; each task has its own run id
    for task, (state, attempt) in enumerate(
        [("COMPLETED", 0), ("COMPLETED", 1), ("CANCELLED", 0), ("COMPLETED", 0)]
    ):
        job = f"{sweep.job}_{task}"
        assert re.match(
            rf"{job}\s+{state}\b.*\s{attempt}\s+slurm-{job}\s+{re.escape(RUNS[task])}$",
            lines[task + 1],
        ), done.stdout
    assert lines[-1] == "# 4 runs: 3 COMPLETED, 1 CANCELLED", done.stdout
    one = sweep.ddpkit("status", f"{sweep.job}_2")
    assert one.stdout.startswith("CANCELLED"), one.stdout + one.stderr
    logs = sweep.ddpkit("logs", f"{sweep.job}_3", "--rank", "1")
    assert logs.returncode == 0, logs.stderr
    expected = (sweep.workdir / "logs" / RUNS[3] / f"sweep-{sweep.job}_3-rank1.out").read_text()
    assert logs.stdout == expected and expected


def test_more_runs_than_max_array_size_are_refused_with_nothing_submitted(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    limit = int(
        re.search(r"MaxArraySize\s*=\s*(\d+)", slurm.run("scontrol", "show", "config").stdout)[1]
    )  # type: ignore[index]
    (tmp_path / "job.yaml").write_text(
        f"name: ddpkit-too-big-sweep\ncommand: x.py {{i}}\nworkdir: {tmp_path}\n"
    )
    env = {**slurm.env, "DDPKIT_HOME": str(tmp_path / "home")}
    values = ",".join(str(i) for i in range(limit + 1))
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "submit", "job.yaml", "--sweep", f"i={values}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert f"more than this cluster's MaxArraySize={limit} allows" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "home").exists() and not (tmp_path / "ddpkit-logs").exists()
    queued = slurm.run(
        "squeue", "--noheader", "--name", "ddpkit-too-big-sweep", "--format", "%i"
    ).stdout
    assert not queued.strip(), f"something was submitted: {queued}"
    assert os.listdir(tmp_path) == ["job.yaml"]
