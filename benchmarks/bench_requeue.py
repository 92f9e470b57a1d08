"""Time from a stop signal to the requeued job's first step, on the real SLURM test cluster.

Needs the cluster of ``ci/slurm-up`` (``source /tmp/ddpkit-slurm/env.sh`` first, or set
SLURM_CONF). Each trial submits examples/train.py (2 nodes x 1 process, launch: srun) with
``ddpkit submit``, waits for its first checkpoint, sends ``scancel --signal=USR2`` and times,
by polling every 50 ms from outside:

  saved      the stop step's checkpoint file exists          (agreement + save)
  left       the job is no longer RUNNING (requeue issued)
  ended      the first run's processes are gone (not COMPLETING any more)
  running    SLURM started the requeued run
  resumed    the requeued run printed "resumed from" (its first step comes next)

The peer, run side by side (the order alternating from trial to trial): submitit's own
preemption path on the same cluster and payload (benchmarks/requeue_peer.py: the same data,
model and steps in plain torch, as a ``submitit.helpers.Checkpointable``): the same signal,
submitit's handler saves on rank 0 and requeues, the requeued run loads the checkpoint and
prints "resumed from"; the same marks, timed the same way. A fresh submission of ddpkit's job,
from ``ddpkit submit`` to its "ddpkit: slurm, world size" line, is shown as a reference (it
skips SLURM's KillWait and requeue hold: what starting the job costs, not a preemption).

    python benchmarks/bench_requeue.py --trials 2 [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchjson

# report-needs: slurm
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
POLL_S = 0.05


def sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def state(job: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job], capture_output=True, text=True, check=False
    ).stdout
    found = re.search(r"JobState=(\S+)", out)
    return found.group(1) if found else ""


def logs(folder: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(folder.glob("*.out")))


def wait(check: object, what: str, timeout_s: float = 180) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return time.monotonic()
        time.sleep(POLL_S)
    raise SystemExit(f"timed out waiting for {what}")


def submit(work: Path, extra: str) -> str:
    spec = work / "job.yaml"
    spec.write_text(
        f"name: bench-requeue\npartition: debug\nnodes: 2\nprocs_per_node: 1\ntime_min: 10\n"
        f"workdir: {work}\nlog_dir: logs\nenv: {{OMP_NUM_THREADS: '1'}}\n"
        f"command: {EXAMPLE} --epochs 2 --train-size 4000 --test-size 501 "
        f"--checkpoint-every 5 --step-delay 0.05 {extra}\n"
    )
    return sh(sys.executable, "-m", "ddpkit", "submit", str(spec)).strip()


def fresh(root: Path) -> float:
    """Seconds from ``ddpkit submit`` to the run's "world size" line (baseline)."""
    work = Path(tempfile.mkdtemp(dir=root))
    start = time.monotonic()
    job = submit(work, "")
    seen = wait(lambda: "world size" in logs(work / "logs"), "the fresh run's start")
    wait(lambda: state(job) == "COMPLETED", "the fresh run's end")
    return seen - start


def requeued(root: Path) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(dir=root))
    ck = work / "ck"
    job = submit(work, f"--checkpoint-dir {ck}")
    return preempted(job, work, ck)


def submitit_requeued(root: Path) -> dict[str, float]:
    """The peer: submitit's Checkpointable on the same payload, preempted the same way."""
    import submitit
    from requeue_peer import Train

    work = Path(tempfile.mkdtemp(dir=root))
    ck = work / "ck"
    ck.mkdir()
    executor = submitit.AutoExecutor(folder=work / "logs", cluster="slurm")
    executor.update_parameters(
        nodes=2, tasks_per_node=1, cpus_per_task=1, timeout_min=10, slurm_partition="debug"
    )
    job = executor.submit(Train(str(ck), epochs=2, train_size=4000, every=5, delay=0.05))
    return preempted(str(job.job_id), work, ck)


def preempted(job: str, work: Path, ck: Path) -> dict[str, float]:
    """Seconds from ``scancel --signal=USR2`` (after the first checkpoint) to each mark."""
    wait(lambda: any(ck.glob("ckpt-*.pt")), "the first checkpoint")
    before = {p.name for p in ck.glob("ckpt-*.pt")}
    sh("scancel", "--signal=USR2", job)
    t0 = time.monotonic()
    marks = {
        "saved": wait(lambda: "stop signal: saved" in logs(work / "logs"), "the stop checkpoint"),
        "left": wait(lambda: state(job) != "RUNNING", "the requeue"),
        "ended": wait(lambda: state(job) in ("PENDING", "REQUEUED"), "the first run's end"),
        "running": wait(lambda: state(job) == "RUNNING", "the requeued run"),
        "resumed": wait(lambda: "resumed from" in logs(work / "logs"), "the resumed run"),
    }
    wait(lambda: state(job) == "COMPLETED", "the requeued run's end")
    assert {p.name for p in ck.glob("ckpt-*.pt")} != before
    return {name: at - t0 for name, at in marks.items()}


DDPKIT = "ddpkit requeue: signal -> training"
SUBMITIT = "submitit Checkpointable requeue: signal -> training"
FRESH = "fresh submission: submit -> training"  # a reference (why.yaml's _references)


def rows(
    fresh_s: list[float], ours: list[dict[str, float]], peer: list[dict[str, float]]
) -> list[dict[str, object]]:
    """The report's rows: each side's marks (medians), and signal -> training again of both
    sides with their trials (run side by side), the fresh submission beside them."""
    trials = len(ours)
    out: list[dict[str, object]] = []
    for side, runs in (("ddpkit", ours), ("submitit", peer)):
        phases = f"seconds after the stop signal, {side} (median of {trials}; 2 nodes x 1 process)"
        for key in runs[0]:
            value = statistics.median(run[key] for run in runs)
            out.append(benchjson.row(phases, key, value, "s", False))
    again = f"back to training (median of {trials})"
    for name, values in (
        (DDPKIT, [run["resumed"] for run in ours]),
        (SUBMITIT, [run["resumed"] for run in peer]),
        (FRESH, fresh_s),
    ):
        out.append(benchjson.row(again, name, statistics.median(values), "s", False, trials=values))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.trials = 1
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit("set SLURM_CONF: source /tmp/ddpkit-slurm/env.sh (after ci/slurm-up)")
    kill_wait = re.search(r"KillWait\s*=\s*(\S+)", sh("scontrol", "show", "config"))
    print(f"cluster: KillWait {kill_wait.group(1) if kill_wait else '?'}; polling every 50 ms")
    # submitit's tasks import the peer's class (PYTHONPATH) and run on one thread, as the spec's
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")])
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="bench-requeue-") as tmp:
        root = Path(tmp)
        base: list[float] = []
        ours: list[dict[str, float]] = []
        peer: list[dict[str, float]] = []
        for trial in range(args.trials):  # side by side, the order alternating
            sides = [
                lambda: ours.append(requeued(root)),
                lambda: peer.append(submitit_requeued(root)),
            ]
            for side in sides if trial % 2 == 0 else sides[::-1]:
                side()
            base.append(fresh(root))
            for name, run in (("ddpkit", ours[-1]), ("submitit", peer[-1])):
                phases = "  ".join(f"{k} {v:5.2f}" for k, v in run.items())
                print(f"trial {trial}: {name:8s} signal-> {phases}")
            print(f"trial {trial}: fresh submit->training {base[-1]:5.2f} s")
    found = rows(base, ours, peer)
    for row in found:
        if str(row["figure"]).startswith("back to training"):
            print(f"{row['variant']}: {row['value']:.2f} s  {row.get('trials')}")
    title = "Preemption: stop signal -> checkpoint -> requeue -> training again (test cluster)"
    benchjson.write(args.json, "requeue", title, "python", found)


if __name__ == "__main__":
    main()
