"""Preemption on the real SLURM cluster: stop signal -> checkpoint -> requeue -> exact resume.

Four jobs of examples/train.py, 2 nodes x 1 process each, run at the same time (the module
fixture submits them together, so the suite waits for the slowest, not for the sum):

* ``srun``, ``torchrun`` (launch modes of the sbatch templates) and ``submitit``: once the
  first checkpoint exists, ``scancel --signal=USR2 <job>`` (what SLURM's own warning does);
* ``timelimit``: nobody sends anything; ``time_min: 2`` with ``signal_delay_s: 60`` makes SLURM
  signal the batch shell (``--signal=B:USR2@60``), whose trap passes it on to the step;
* ``startup``: ``scancel --batch --signal=USR2`` (what SLURM's warning does) every few tenths of a
  second from the moment the batch shell has set its trap (its latch folder exists) until the
  ranks agree to stop: at many moments of srun's and Python's start, before any rank latched.
  The shell holds the signal until every process has latched it, so none dies of it.

Each must be requeued at least once (sacct lists a REQUEUED run before the COMPLETED one),
resume from its checkpoint, and end with weights bitwise identical to an uninterrupted run of
the same command (``ddpkit run --nproc-per-node 2`` on this machine: CPU and world size 2,
where gloo's sum of two values does not depend on order, make the comparison exact).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_cluster import FINISHED, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
TRAIN = "--epochs 3 --train-size 4000 --test-size 501 --checkpoint-every 5"
HASH = re.compile(r"weights sha256: ([0-9a-f]{64})")
JOBS_TIMEOUT_S = 420


@dataclass
class Scenario:
    name: str
    fields: str  # YAML lines of the spec
    via: str = "sbatch"
    step_delay: float = 0.1
    signal_by_hand: bool = True
    storm: bool = False  # signal the batch shell from its start until the ranks stop


SCENARIOS = {
    "srun": Scenario("srun", "launch: srun\ntime_min: 5\n"),
    "torchrun": Scenario("torchrun", "launch: torchrun\nrdzv_port: auto\ntime_min: 5\n"),
    "submitit": Scenario("submitit", "launch: srun\ntime_min: 5\n", via="submitit"),
    # ~70 s of steps: SLURM's warning (60 s before a 2 min limit, checked every 30 s) comes
    # 30-60 s after the start, so at least the first run is cut short.
    "timelimit": Scenario(
        "timelimit",
        "launch: srun\ntime_min: 2\nsignal_delay_s: 60\n",
        step_delay=0.7,
        signal_by_hand=False,
    ),
    "startup": Scenario("startup", "launch: srun\ntime_min: 5\n", signal_by_hand=False, storm=True),
}
STOPPING = "every rank stops after this step"


@dataclass
class Outcome:
    job_id: str
    workdir: Path
    history: list[tuple[str, str]]  # (State, ExitCode) of each run of the job, oldest first
    logs: str  # every log file of the job, concatenated
    signalled_at: float | None
    held: int  # storm: signals sent to the batch shell before every process had latched


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 120) -> str:
    done = subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def history(slurm: SlurmCluster, job_id: str) -> list[tuple[str, str]]:
    """Every run of the job (sacct --duplicates), allocation lines only."""
    out = slurm.run(
        "sacct", "-j", job_id, "--duplicates", "-n", "-P", "-X", "-o", "JobID,State,ExitCode"
    ).stdout
    return [tuple(line.split("|")[1:3]) for line in out.splitlines() if line.strip()]  # type: ignore[misc]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final weights of an uninterrupted run (no checkpoint dir, no signal)."""
    where = tmp_path_factory.mktemp("reference")
    out = run(
        [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", str(EXAMPLE),
         *TRAIN.split()],
        env={**_base_env(), "OMP_NUM_THREADS": "1"},
        cwd=where,
    )  # fmt: skip
    found = HASH.findall(out)
    assert len(found) == 1, out
    return found[0]


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPKIT_"))}


@pytest.fixture(scope="module")
def outcomes(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Outcome]:
    slurm = slurm_cluster
    if not slurm.accounting:
        pytest.fail("these tests read the job's runs from sacct: start ci/slurm-up with accounting")
    env = {**slurm.env, "DDPKIT_HOME": str(tmp_path_factory.mktemp("home"))}
    submitted: dict[str, tuple[str, Path]] = {}
    try:
        for name, case in SCENARIOS.items():
            workdir = tmp_path_factory.mktemp(name)
            spec = workdir / "job.yaml"
            spec.write_text(
                f"name: pre-{name}\npartition: debug\nnodes: 2\nprocs_per_node: 1\n"
                f"workdir: {workdir}\nlog_dir: logs\nenv: {{OMP_NUM_THREADS: '1'}}\n"
                f"command: {EXAMPLE} {TRAIN} --checkpoint-dir {workdir / 'ck'} "
                f"--step-delay {case.step_delay}\n{case.fields}"
            )
            job_id = run(
                [sys.executable, "-m", "ddpkit", "submit", str(spec), "--via", case.via],
                env=env,
                cwd=workdir,
            ).strip()
            submitted[name] = (slurm.track(job_id), workdir)
        signalled, held = _signal_when_training(slurm, submitted)
        deadline = time.monotonic() + JOBS_TIMEOUT_S
        for job_id, _ in submitted.values():
            slurm.wait(job_id, timeout_s=max(1.0, deadline - time.monotonic()), states=FINISHED)
        return {
            name: Outcome(
                job_id,
                workdir,
                history(slurm, job_id),
                "\n".join(
                    f"==> {path.name}\n{path.read_text(errors='replace')}"
                    for path in sorted((workdir / "logs").glob("*"))
                    if path.is_file() and path.suffix in (".out", ".err")
                ),
                signalled.get(name),
                held.get(name, 0),
            )
            for name, (job_id, workdir) in submitted.items()
        }
    finally:
        slurm.cancel_tracked()


def _signal_when_training(
    slurm: SlurmCluster, submitted: dict[str, tuple[str, Path]]
) -> tuple[dict[str, float], dict[str, int]]:
    """Signal the jobs: each hand-signalled one once its first checkpoint exists (``scancel
    --signal=USR2``), each storm one's batch shell from its start until its ranks stop; when
    each was signalled, and how many storm signals came before every process had latched."""
    waiting = {n: submitted[n] for n, case in SCENARIOS.items() if case.signal_by_hand}
    storming = {n: submitted[n] for n, case in SCENARIOS.items() if case.storm}
    signalled: dict[str, float] = {}
    held = dict.fromkeys(storming, 0)
    deadline = time.monotonic() + 180
    while (waiting or storming) and time.monotonic() < deadline:
        for name, (job_id, workdir) in list(waiting.items()):
            if any((workdir / "ck").glob("ckpt-*.pt")):
                slurm.run("scancel", "--signal=USR2", job_id)
                signalled[name] = time.monotonic()
                del waiting[name]
        for name, (job_id, workdir) in list(storming.items()):
            if STOPPING in _task_logs(workdir):
                del storming[name]
                continue
            latch_dirs = list((workdir / "logs").glob(".ddpkit-latched-*"))
            if latch_dirs:  # created after the batch shell's trap: no signal can come earlier
                slurm.run("scancel", "--batch", "--signal=USR2", job_id, check=False)
                signalled.setdefault(name, time.monotonic())
                if _markers(latch_dirs) < 2:  # markers only appear: fewer when it was sent too
                    held[name] += 1
        time.sleep(0.2)
    assert not waiting, f"no checkpoint appeared in time for {sorted(waiting)}"
    assert not storming, f"no rank stopped in time in {sorted(storming)}"
    return signalled, held


def _task_logs(workdir: Path) -> str:
    return "".join(
        path.read_text(errors="replace") for path in (workdir / "logs").glob("*-rank*.out")
    )


def _markers(latch_dirs: list[Path]) -> int:
    count = 0
    for folder in latch_dirs:
        with contextlib.suppress(OSError):  # the batch shell removes it when it ends
            count += len(os.listdir(folder))
    return count


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_stop_signal_requeues_and_resumes_exactly(
    name: str, outcomes: dict[str, Outcome], reference: str
) -> None:
    outcome = outcomes[name]
    where = f"job {outcome.job_id} ({name}); logs:\n{outcome.logs[-6000:]}"
    states = [state for state, _ in outcome.history]
    assert states[-1] == "COMPLETED", f"runs {outcome.history}; {where}"
    assert "REQUEUED" in states[:-1], f"never requeued: runs {outcome.history}; {where}"
    assert STOPPING in outcome.logs, where
    assert re.search(r"requeue \S+ \(1 of 10\): done", outcome.logs), where
    assert re.search(r"resumed from \S+ at step [1-9]\d* ", outcome.logs), where
    hashes = HASH.findall(outcome.logs)
    assert hashes == [reference], f"final weights {hashes} != uninterrupted {reference}; {where}"
    if name in ("timelimit", "startup"):  # to the batch shell, which held it, then passed it on
        assert "ddpkit: SIGUSR2: time limit near; holding it until every" in outcome.logs, where
        assert "SIGUSR2: every process has latched it, passing it on" in outcome.logs, where
    if name == "startup":  # signals came while the tasks were starting, before they latched
        assert outcome.held > 0, where
