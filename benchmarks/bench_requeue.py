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

The baseline, run side by side: a fresh submission of the same job, from ``ddpkit submit`` to
the same point (its "ddpkit: slurm, world size" line, printed right before the data and the
model are built; the resumed run's line comes after the checkpoint load). The ratio compares
"signal -> training again" with "submit -> training": what a preemption costs on top of
simply starting the job, on an idle cluster.

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
    with tempfile.TemporaryDirectory(prefix="bench-requeue-") as tmp:
        root = Path(tmp)
        base, runs = [], []
        for trial in range(args.trials):  # alternate the two sides
            base.append(fresh(root))
            runs.append(requeued(root))
            phases = "  ".join(f"{k} {v:5.2f}" for k, v in runs[-1].items())
            print(f"trial {trial}: submit->training {base[-1]:5.2f} s | signal-> {phases}")
    med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    fresh_s = statistics.median(base)
    print("median seconds after the signal: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    print(f"baseline (fresh submit -> training): {fresh_s:.2f} s")
    print(f"signal -> training again: {med['resumed']:.2f} s, ratio to a fresh start "
          f"{med['resumed'] / fresh_s:.2f}")  # fmt: skip
    phases = f"seconds after the stop signal (median of {args.trials}; 2 nodes x 1 process)"
    rows = [benchjson.row(phases, name, value, "s", False) for name, value in med.items()]
    again = f"back to training (median of {args.trials})"
    rows.append(benchjson.row(again, "fresh submission: submit -> training", fresh_s, "s", False))
    rows.append(
        benchjson.row(again, "ddpkit requeue: signal -> training", med["resumed"], "s", False)
    )
    title = "Preemption: stop signal -> checkpoint -> requeue -> training again (test cluster)"
    benchjson.write(args.json, "requeue", title, "python", rows)


if __name__ == "__main__":
    main()
