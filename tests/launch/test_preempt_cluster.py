"""Preemption on the real SLURM cluster: stop signal -> checkpoint -> requeue -> exact resume.

Six jobs, 2 nodes x 1 process each, run at the same time (the module fixture submits them
together, so the suite waits for the slowest, not for the sum):

* ``srun`` and ``submitit``: once the first checkpoint exists, ``scancel --signal=USR2 <job>``
  (what SLURM's own warning does);
* ``timelimit``: nobody sends anything; ``time_min: 2`` with ``signal_delay_s: 60`` makes SLURM
  signal the batch shell (``--signal=B:USR2@60``), whose trap passes it on to the step;
* ``startup``: ``scancel --batch --signal=USR2`` (what SLURM's warning does) every few tenths of a
  second from the moment the batch shell has set its trap (its latch folder exists) until the
  ranks agree to stop: at many moments of srun's and Python's start, before any rank latched.
  The shell holds the signal until every process has latched it, so none dies of it;
* ``direct``, ``direct-torchrun``: ``scancel --signal=USR2`` (every process of the step at once,
  as a user would send it) every few tenths of a second from the moment each task's wrapper has
  started its command until the ranks agree to stop: the wrapper holds it for a Python that has
  not latched it yet, and under torchrun the workers start with it blocked. This is also the
  test of ``launch: torchrun`` (the sbatch templates' other launch mode): the same ``scancel``
  as by hand, to the agents and the workers, from before they latch until they stop.

Each must be requeued at least once (sacct lists a REQUEUED run before the COMPLETED one) and
resume from its checkpoint. ``srun`` trains (examples/train.py) and must end with weights bitwise
identical to an uninterrupted run of the same command (2 ranks on this machine: CPU and world
size 2, where gloo's sum of two values does not depend on order, make the comparison exact).
The others judge how the signal reaches the ranks and how the job comes back, which needs no
torch: they run tests/scripts/preempt_stop.py (ddpkit's torch-free stop path, the ranks agreeing
on the step through files), whose every rank must have run each step exactly once over the
job's runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddpkit.cluster.stop.forward import child_pids
from ddpkit.contract import STOP_HOLD_MODULE
from tests.support.ports import free_port
from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train.py"
STOP_ONLY = ROOT / "tests" / "scripts" / "preempt_stop.py"  # torch-free: see the module doc
STOP_STEPS = 100
TRAIN = "--epochs 3 --train-size 4000 --test-size 501 --checkpoint-every 5"
HASH = re.compile(r"weights sha256: ([0-9a-f]{64})")
JOBS_TIMEOUT_S = 600  # six jobs on 2 nodes, and the time-limit one may run 3 times


@dataclass
class Scenario:
    name: str
    fields: str  # YAML lines of the spec
    via: str = "sbatch"
    step_delay: float = 0.1
    signal_by_hand: bool = True
    # "batch": scancel --batch --signal=USR2 from the batch shell's start until the ranks stop;
    # "direct": scancel --signal=USR2 (every process of the step) from the tasks' start
    storm: str | None = None
    latches: int = 2  # processes that latch: the ranks, plus the agents under torchrun
    trains: bool = False  # examples/train.py (exact weights), else preempt_stop.py

    def command(self, workdir: Path) -> str:
        ck = f"--checkpoint-dir {workdir / 'ck'} --step-delay {self.step_delay}"
        if self.trains:
            return f"{EXAMPLE} {TRAIN} {ck}"
        return f"{STOP_ONLY} --steps {STOP_STEPS} {ck}"


SCENARIOS = {
    "srun": Scenario("srun", "launch: srun\ntime_min: 5\n", trains=True),
    # preempt_stop.py's steps take only their delay (train.py's also ~0.1 s of work): 0.3 s
    # leaves ~30 s after the first checkpoint for the hand signal to come in a loaded run
    "submitit": Scenario("submitit", "launch: srun\ntime_min: 5\n", via="submitit", step_delay=0.3),
    # ~70 s of steps: SLURM's warning (60 s before a 2 min limit, checked every 30 s) comes
    # 30-60 s after the start, so at least the first run is cut short.
    "timelimit": Scenario(
        "timelimit",
        "launch: srun\ntime_min: 2\nsignal_delay_s: 60\n",
        step_delay=0.7,
        signal_by_hand=False,
    ),
    "startup": Scenario(
        "startup", "launch: srun\ntime_min: 5\n", signal_by_hand=False, storm="batch"
    ),
    "direct": Scenario(
        "direct", "launch: srun\ntime_min: 5\n", signal_by_hand=False, storm="direct"
    ),
    "direct-torchrun": Scenario(
        "direct-torchrun",
        "launch: torchrun\nrdzv_port: auto\ntime_min: 5\n",
        signal_by_hand=False,
        storm="direct",
        latches=4,
    ),
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
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], str]]:
    """The final weights of an uninterrupted run (no checkpoint dir, no signal), read when
    first asked: the run starts before the jobs are submitted (``outcomes`` asks for this
    fixture first) and runs while they wait for the cluster, not after them. Its 2 ranks are
    started with torch's env:// variables, as a launcher would set them: no launcher is under
    test here, and ``ddpkit run``'s agent would import torch a third time."""
    where = tmp_path_factory.mktemp("reference")
    port = free_port()  # for rank 0's store
    procs = []
    for rank in range(2):
        ranks = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        with (where / f"out-{rank}.txt").open("w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(EXAMPLE), *TRAIN.split()],
                env={**_base_env(), "OMP_NUM_THREADS": "1", **ranks},
                cwd=where, stdout=out, stderr=subprocess.STDOUT, text=True,
            ))  # fmt: skip

    def weights() -> str:
        codes = [proc.wait(timeout=120) for proc in procs]
        text = "".join((where / f"out-{rank}.txt").read_text(errors="replace") for rank in (0, 1))
        found = HASH.findall(text)
        assert codes == [0, 0] and len(found) == 1, f"reference run exits {codes}:\n{text}"
        return found[0]

    try:
        yield weights
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPKIT_"))}


@pytest.fixture(scope="module")
def outcomes(
    slurm_cluster: SlurmCluster,
    tmp_path_factory: pytest.TempPathFactory,
    reference: Callable[[], str],  # started first, to run beside the jobs
) -> dict[str, Outcome]:
    slurm = slurm_cluster
    if not slurm.accounting:
        pytest.fail("these tests read the job's runs from sacct: start ci/slurm-up with accounting")
    env = {**slurm.env, "DDPKIT_HOME": str(tmp_path_factory.mktemp("home"))}
    submitted: dict[str, tuple[str, Path]] = {}
    try:
        specs = {}
        for name, case in SCENARIOS.items():
            workdir = tmp_path_factory.mktemp(name)
            spec = workdir / "job.yaml"
            spec.write_text(
                f"name: pre-{name}\npartition: debug\nnodes: 2\nprocs_per_node: 1\n"
                f"workdir: {workdir}\nlog_dir: logs\nenv: {{OMP_NUM_THREADS: '1'}}\n"
                f"command: {_task_gate(case, workdir)}{case.command(workdir)}\n"
                f"{case.fields}{_gate(case, workdir)}"
            )
            specs[name] = (spec, case.via)
        # submitted at the same time: one after the other, seven `ddpkit submit` (each a
        # Python start) took ~40 s on a loaded machine before the last job was queued
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                name: pool.submit(
                    run,
                    [sys.executable, "-m", "ddpkit", "submit", str(spec), "--via", via],
                    env=env,
                    cwd=spec.parent,
                )
                for name, (spec, via) in specs.items()
            }
        for name, future in futures.items():  # every job that was submitted is tracked
            with contextlib.suppress(Exception):
                submitted[name] = (slurm.track(future.result().strip()), specs[name][0].parent)
        for future in futures.values():
            future.result()  # the first that failed fails the test, saying why
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
    --signal=USR2``, in a thread of its own), each storm one from its start until its ranks
    stop; when each was signalled, and how many storm signals came before every process had
    latched.

    The hand signals once shared the storms' loop: with three storms, each scancel given up to
    STORM_SIGNAL_S, a loaded machine's loop signalled the srun job ~16 s after its first
    checkpoint, 6 s after its training had ended (sacct: COMPLETED, never requeued; CI,
    2026-11-28)."""
    waiting = {n: submitted[n] for n, case in SCENARIOS.items() if case.signal_by_hand}
    storming = {n: submitted[n] for n, case in SCENARIOS.items() if case.storm}
    signalled: dict[str, float] = {}
    held = dict.fromkeys(storming, 0)
    deadline = time.monotonic() + JOBS_TIMEOUT_S
    failed: list[BaseException] = []  # the thread's own failure (a scancel that failed)
    by_hand = threading.Thread(
        target=_signal_by_hand, args=(slurm, waiting, signalled, deadline, failed), daemon=True
    )
    by_hand.start()
    while storming and time.monotonic() < deadline:
        for name, (job_id, workdir) in list(storming.items()):
            case = SCENARIOS[name]
            if STOPPING in _task_logs(workdir):
                del storming[name]
            elif name in signalled or _storm_may_start(case, workdir):
                _storm_signal(slurm, job_id, batch=case.storm == "batch")
                signalled.setdefault(name, time.monotonic())
                (workdir / "go").touch()  # a gated batch shell goes on only now (_gate)
                # markers only appear: fewer after the signal means fewer when it was sent
                if _markers(workdir) < case.latches:
                    held[name] += 1
        time.sleep(0.2)
    by_hand.join(max(0.0, deadline - time.monotonic()) + 5)
    if failed:
        raise failed[0]
    assert not waiting, f"no checkpoint appeared in time for {sorted(waiting)}"
    assert not storming, f"no rank stopped in time in {sorted(storming)}"
    return signalled, held


def _signal_by_hand(
    slurm: SlurmCluster,
    waiting: dict[str, tuple[str, Path]],
    signalled: dict[str, float],
    deadline: float,
    failed: list[BaseException],
) -> None:
    """``scancel --signal=USR2`` each job of ``waiting`` once its first checkpoint exists (and
    take it out of ``waiting``), until none waits or the deadline passes; what stopped it early
    goes into ``failed``, for the test's thread to raise."""
    try:
        for _, workdir in waiting.values():  # the jobs train only now (_gate): on a loaded
            (workdir / "watched").touch()  # machine, submitting the jobs took long enough
        while waiting and time.monotonic() < deadline:
            for name, (job_id, workdir) in list(waiting.items()):
                if any((workdir / "ck").glob("ckpt-*.pt")):
                    slurm.run("scancel", "--signal=USR2", job_id)
                    signalled[name] = time.monotonic()
                    del waiting[name]
            time.sleep(0.1)
    except BaseException as exc:  # pytest.fail's too: raised again by the test's thread
        failed.append(exc)


# scancel retries a job "in a transitional state" (ending, or pending after a requeue) by
# itself, sleeping 5, 6, 7 ... s between tries, until the job runs again: a storm's signal
# sent as the first run ended reached the requeued run's batch shell 18 s later, before its
# trap was set, and killed it (sacct: FAILED 0:12, in CI). A storm's signal is for the run it
# was sent to: scancel is given less than its first retry's sleep, then killed (it is asleep).
STORM_SIGNAL_S = 3.0


def _storm_signal(slurm: SlurmCluster, job_id: str, *, batch: bool) -> None:
    argv = ["scancel", *(["--batch"] if batch else []), "--signal=USR2", job_id]
    with contextlib.suppress(subprocess.TimeoutExpired):  # killed by subprocess.run
        slurm.run(*argv, check=False, timeout_s=STORM_SIGNAL_S)


def _gate(case: Scenario, workdir: Path) -> str:
    """A batch storm's job waits in its setup lines (after the shell's trap and latch folder,
    before any task starts) until its first signal has been sent: so that signal always comes
    before any process has latched, however slowly this test's loop runs on a loaded machine
    (ungated, it once came only after both ranks had latched)."""
    if case.signal_by_hand:  # ... and a hand-signalled job until the test watches for it
        gate = workdir / "watched"
    elif case.storm == "batch":
        gate = workdir / "go"
    else:
        return ""
    return f"setup: ['while [ ! -e {gate} ]; do sleep 0.1; done']\n"


_TASK_GATE = """\
import runpy, sys, time
from pathlib import Path

go, deadline = Path({go!r}), time.monotonic() + 600
while not go.exists():  # bounded: a test that never says go must not leave a task behind
    if time.monotonic() > deadline:
        sys.exit("gate: no go within 600 s")
    time.sleep(0.1)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _task_gate(case: Scenario, workdir: Path) -> str:
    """A direct storm's ranks wait in a gate script (under the task's holder, the signal still
    blocked) until the first signal has been sent, then run the training script: so that signal
    always comes before any rank has latched. Ungated, on a loaded machine, the storm's first
    signal once came only after both ranks had latched (held 0), and the case tested nothing."""
    if case.storm != "direct":
        return ""
    gate = workdir / "gate.py"
    gate.write_text(_TASK_GATE.format(go=str(workdir / "go")))
    return f"{gate} "


def _storm_may_start(case: Scenario, workdir: Path) -> bool:
    """Synchronization, not timing: the batch shell has set its trap (its latch folder, made
    after it, exists), or every task's wrapper has set its own and started its command."""
    if case.storm == "batch":
        return bool(list((workdir / "logs").glob(".ddpkit-latched-*")))
    marker = str(workdir / "ck").encode()
    wrappers = 0
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or it just ended
            continue
        wrapper = argv[1:3] == [b"-m", STOP_HOLD_MODULE.encode()]  # not srun's own argv
        if wrapper and marker in argv and child_pids(int(entry.name)):
            wrappers += 1
    return wrappers == 2  # 2 nodes x 1 task


def _task_logs(workdir: Path) -> str:
    """Every output file of the job: the tasks' (-rank%t, or -node%n under torchrun), the batch
    shell's."""
    return "".join(path.read_text(errors="replace") for path in (workdir / "logs").glob("*.out"))


def _markers(workdir: Path) -> int:
    count = 0
    for folder in (workdir / "logs").glob(".ddpkit-latched-*"):
        with contextlib.suppress(OSError):  # the batch shell removes it when it ends
            count += len(os.listdir(folder))
    return count


# The module fixture (all the jobs, minutes) runs in the first test's setup, which pytest-timeout
# bounds with the suite's 300 s: under CI load it passed that bound once while its own wait for
# the jobs (JOBS_TIMEOUT_S, after submitting and signalling them) still had minutes to go.
@pytest.mark.timeout(JOBS_TIMEOUT_S + 300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_stop_signal_requeues_and_resumes_exactly(
    name: str, outcomes: dict[str, Outcome], reference: Callable[[], str]
) -> None:
    outcome = outcomes[name]
    where = f"job {outcome.job_id} ({name}); logs:\n{outcome.logs[-6000:]}"
    states = [state for state, _ in outcome.history]
    assert states[-1] == "COMPLETED", f"runs {outcome.history}; {where}"
    assert "REQUEUED" in states[:-1], f"never requeued: runs {outcome.history}; {where}"
    assert STOPPING in outcome.logs, where
    asked = r"requeue \S+ \(1 of 10\): asking SLURM to put the job back"
    assert re.search(asked, outcome.logs), where
    assert re.search(r"resumed from \S+ at step [1-9]\d* ", outcome.logs), where
    if SCENARIOS[name].trains:
        weights = reference()
        hashes = HASH.findall(outcome.logs)
        assert hashes == [weights], f"final weights {hashes} != uninterrupted {weights}; {where}"
    else:  # resumed exactly after the agreed step: no step lost, none run twice
        assert f"result: every rank ran {STOP_STEPS} steps" in outcome.logs, where
        for rank in range(2):
            ran = (outcome.workdir / "ck" / f"steps-{rank}.txt").read_text().split()
            assert ran == [str(s) for s in range(1, STOP_STEPS + 1)], f"rank {rank}; {where}"
    if name in ("timelimit", "startup"):  # to the batch shell, which held it, then passed it on
        assert "ddpkit: SIGUSR2: time limit near; holding it until every" in outcome.logs, where
        assert "SIGUSR2: every process has latched it, passing it on" in outcome.logs, where
    if SCENARIOS[name].storm:  # signals came while the tasks were starting, before they latched
        assert outcome.held > 0, where
