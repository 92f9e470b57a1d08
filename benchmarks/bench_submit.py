"""Submission overhead: `ddpkit submit` vs torchx's `torchx run -s slurm`, and plain `sbatch`.

    ci/slurm-up && python benchmarks/bench_submit.py [--runs 9] [--payload trivial|torch]
        [--settle-s 0.5] [--slurm-env /tmp/ddpkit-slurm/env.sh] [--quick] [--json FILE]

Three commands submit the same payload (1 node, 1 process) to the running test cluster, in
turn, each on an idle cluster (previous job ended, every node idle again, then a short pause):
``ddpkit submit`` of a spec; ``torchx run -s slurm utils.python --script`` (the peer: another
command that turns a job description into an sbatch, as a torchx user types it); and plain
``sbatch`` of the very script ``ddpkit submit --dry-run`` prints (a reference, not a peer: the
floor under any wrapper, since ddpkit submit runs that sbatch itself). The time taken is from
starting the command to the first complete line in the job's rank-0 output file (polled every
5 ms), and until the command returned the job id (ddpkit's own cost: Python start-up,
validation, rendering, the record). Medians and every trial go into the JSON; the ratios are
printed against torchx. --settle-s is the pause on the idle cluster before each run.

SLURM starts a batch job at a scheduling pass (every ``sched_interval`` s, 2 on the test
cluster), and the bench's rhythm (wait for the last job's end, the idle nodes, the pause) locks
each trial to the same moment between two passes: a command that reaches sbatch sooner then
waits longer for the pass, the same every trial (plain sbatch, 0.23 s ahead of ddpkit submit,
printed its first line after it in most trials). So each run first waits a random part of the
interval (seeded, the same for every contender of that run): over the runs the pass comes at
any moment, and what a command saves before its sbatch counts as what it is worth on average.
The payload prints one line at once (``trivial``) or after ``import torch`` (``torch``, what a
training job does first). `ddpkit` runs as `python -m ddpkit` (what its console script does,
without a pyenv shim in front).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import benchjson
from benchcluster import DEFAULT_ENV_FILE, cluster_env, wait_idle

from ddpkit.cluster import slurmtools as slurm
from ddpkit.cluster.slurmtools.config import show_config

# report-needs: slurm

POLL_S = 0.005
PAYLOADS = {
    "trivial": "print('first line', flush=True)\n",
    "torch": "import torch\n\nprint('first line', torch.__version__, flush=True)\n",
}
FIRST_LINE_TIMEOUT_S = 60.0
SBATCH = "plain sbatch of the same script"
DDPKIT = "ddpkit submit"
TORCHX = "torchx run -s slurm"


def sched_interval_s(env: dict[str, str]) -> float:
    """SchedulerParameters' ``sched_interval`` (SLURM's default: 60 s), from scontrol."""
    config = show_config(env=env) or {}
    for item in config.get("SchedulerParameters", "").split(","):
        name, _, value = item.partition("=")
        if name.strip() == "sched_interval" and value.strip().isdigit():
            return float(value)
    return 60.0


def torchx_job_id(stdout: str) -> str:
    """The job id of ``torchx run``'s handle (``slurm://torchx/<job id>``, its first line)."""
    for line in stdout.splitlines():
        if line.startswith("slurm://"):
            return line.rsplit("/", 1)[-1].strip()
    raise SystemExit(f"torchx run printed no slurm:// handle: {stdout[-500:]!r}")


def first_line_after(
    submit: Callable[[], str], output: Callable[[str], Path]
) -> tuple[float, float, str]:
    """Seconds from calling ``submit`` to its return and to the first line in ``output(job)``."""
    start = time.perf_counter()
    job_id = submit()
    returned = time.perf_counter() - start
    path = output(job_id)
    deadline = start + FIRST_LINE_TIMEOUT_S
    while time.perf_counter() < deadline:
        try:
            if b"\n" in path.read_bytes():
                return time.perf_counter() - start, returned, job_id
        except FileNotFoundError:
            pass
        time.sleep(POLL_S)
    raise SystemExit(f"job {job_id}: no output line in {path} after {FIRST_LINE_TIMEOUT_S} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--slurm-env", type=Path, default=Path(DEFAULT_ENV_FILE))
    parser.add_argument("--payload", choices=sorted(PAYLOADS), default="trivial")
    parser.add_argument("--settle-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0, help="the runs' random phase offsets")
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
    env = cluster_env(args.slurm_env)
    # /tmp: the nodes of the test cluster see it (a job's files must be reachable from them)
    work = Path(tempfile.mkdtemp(prefix="ddpkit-bench-submit-", dir="/tmp"))
    try:
        bench(args, env, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench(args: argparse.Namespace, env: dict[str, str], work: Path) -> None:
    env["DDPKIT_HOME"] = str(work / "home")
    (work / "first_line.py").write_text(PAYLOADS[args.payload])
    spec = work / "bench.yaml"
    spec.write_text("name: bench\ncommand: first_line.py\nnodes: 1\ntime_min: 5\n")
    log_dir = work / "ddpkit-logs"
    log_dir.mkdir()  # plain sbatch needs it too: SLURM opens the batch output before the script

    def run(argv: list[str], stdin: str | None = None) -> str:
        done = subprocess.run(
            argv, input=stdin, cwd=work, env=env, capture_output=True, text=True, check=True
        )
        return done.stdout

    ddpkit = [sys.executable, "-m", "ddpkit"]
    script = run([*ddpkit, "submit", str(spec), "--dry-run"])
    sbatch = ["sbatch", "--parsable", f"--chdir={work}"]
    torchx = [sys.executable, "-m", "torchx.cli.main", "run", "-s", "slurm"]
    torchx += ["utils.python", "--script", "first_line.py"]
    contenders: dict[str, Callable[[], str]] = {
        SBATCH: lambda: run(sbatch, stdin=script).strip().split(";")[0],
        DDPKIT: lambda: run([*ddpkit, "submit", str(spec)]).strip(),
        TORCHX: lambda: torchx_job_id(run(torchx)),
    }
    outputs: dict[str, Callable[[str], Path]] = {
        SBATCH: lambda job_id: log_dir / f"bench-{job_id}-rank0.out",
        DDPKIT: lambda job_id: log_dir / f"bench-{job_id}-rank0.out",
        # torchx's slurm scheduler: slurm-<job>-<role>-<replica>.out in the directory it ran in
        TORCHX: lambda job_id: work / f"slurm-{job_id}-python-0.out",
    }

    interval = sched_interval_s(env)
    rng = random.Random(args.seed)

    def timed(name: str, offset_s: float = 0.0) -> float:
        time.sleep(offset_s)  # the run's random place between two scheduling passes
        seconds, returned, job_id = first_line_after(contenders[name], outputs[name])
        commands[name].append(returned)
        slurm.wait(job_id, 60, 0.05, env=env)  # the next run starts on an idle cluster
        wait_idle(env, args.settle_s)
        return seconds

    commands: dict[str, list[float]] = {name: [] for name in contenders}
    for name in contenders:  # warm the page cache and SLURM for both
        timed(name)
        commands[name].clear()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(args.runs):
        names = list(contenders)
        order = names[i % len(names) :] + names[: i % len(names)]  # each goes first in turn
        offset_s = rng.uniform(0.0, interval)
        for name in order:
            times[name].append(timed(name, offset_s))
        print(f"run {i}: " + "   ".join(f"{name} {times[name][-1]:.3f} s" for name in names))
    rows = []
    first = f"submit -> the job's first output line, payload {args.payload} (median of {args.runs})"
    back = f"submit command -> job id returned (median of {args.runs})"
    for figure, trials in ((first, times), (back, commands)):
        medians = {name: statistics.median(trials[name]) for name in contenders}
        print(
            f"{figure}: "
            + ", ".join(f"{name} {medians[name]:.3f} s" for name in contenders)
            + f"; ddpkit / torchx {medians[DDPKIT] / medians[TORCHX]:.3f}"
        )
        rows += [
            benchjson.row(
                figure, name, medians[name], "s", False,
                reference=name == SBATCH, trials=trials[name],
            )
            for name in contenders
        ]  # fmt: skip
    means = {name: statistics.fmean(times[name]) for name in contenders}
    pairs = list(zip(times[DDPKIT], times[TORCHX], strict=True))
    later = [ours - theirs for ours, theirs in pairs if ours > theirs]
    notes = [
        f"first output line, mean of {args.runs} runs: "
        + ", ".join(f"{name} {means[name]:.2f} s" for name in contenders)
        + f" (runs spread over SLURM's {interval:g} s scheduling interval, seed {args.seed})",
        f"ddpkit submit's first line came after torchx's in {len(later)} of {len(pairs)} runs"
        + (f", by {min(later):.2f} to {max(later):.2f} s" if later else ""),
    ]
    for note in notes:
        print(note)
    title = "Submission: ddpkit submit vs torchx run, and plain sbatch (test cluster)"
    benchjson.write(args.json, "submit", title, "python", rows, notes=notes)


if __name__ == "__main__":
    main()
