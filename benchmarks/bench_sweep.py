"""Sweep submission: time from submitting N runs to all N running, five ways.

    ci/slurm-up && python benchmarks/bench_sweep.py [--tasks 4] [--runs 3] [--quick]
        [--settle-s 0.5] [--slurm-env /tmp/ddpkit-slurm/env.sh] [--json FILE]

The same N one-node, one-process runs go to the running test cluster as

* ``ddpkit sweep``: one ``ddpkit submit spec.yaml --sweep task=0,...,N-1`` (one SLURM array);
* ``ddpkit submit xN``: N ``ddpkit submit spec.yaml --set command=...`` calls, one after the
  other (what a shell loop over the values does);
* ``submitit map_array``: ``executor.map_array`` of a Python function (one array), in process;
* ``ddpkit api.submit sweep (in process)``: the first one through ``ddpkit.jobs.api`` in this
  process (what the command costs besides Python's start-up and imports);
* ``ddpkit map_function (in process)``: ``ddpkit.jobs.map_function``, ddpkit's counterpart of
  ``map_array`` (it calls it, with the spec's resources and a job record).

Each run writes a marker file first thing and then sleeps; the time measured is from starting
the submission to the moment all N markers exist (polled every 5 ms), on an idle cluster (every
node idle, then --settle-s). The variants alternate order from round to round; medians and the
ratios against ``ddpkit submit xN`` (the plain baseline: no array) are printed. N must fit the
cluster at once (2 nodes x 4 CPUs: N <= 8) or the figure measures the queue instead.
``ddpkit`` runs as ``python -m ddpkit`` (what its console script does).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchcluster import DEFAULT_ENV_FILE, cluster_env, wait_idle

POLL_S = 0.005
ALL_RUNNING_TIMEOUT_S = 120.0
PAYLOAD = (
    "import pathlib, sys, time\npathlib.Path(sys.argv[1], sys.argv[2]).touch()\ntime.sleep(300)\n"
)
VARIANTS = (
    "ddpkit sweep",
    "ddpkit submit xN",
    "submitit map_array",
    "ddpkit api.submit sweep (in process)",
    "ddpkit map_function (in process)",
)


def mark_and_wait(markers: str, index: int | str) -> None:
    """submitit's payload (cloudpickle carries it by value: it lives in __main__)."""
    Path(markers, str(index)).touch()
    time.sleep(300)


class Bench:
    def __init__(self, env: dict[str, str], work: Path, tasks: int) -> None:
        self.env, self.work, self.tasks = env, work, tasks
        (work / "payload.py").write_text(PAYLOAD)
        (work / "spec.yaml").write_text(
            f"name: bench-sweep\nnodes: 1\nprocs_per_node: 1\ntime_min: 5\nworkdir: {work}\n"
            f"python: {sys.executable}\ncommand: payload.py markers 0\n"
        )
        self.jobs: list[str] = []

    def ddpkit(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "ddpkit", *args],
            cwd=self.work, env=self.env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"ddpkit {shlex.join(args)} failed: {done.stderr}")
        return done.stdout.strip()

    def sweep(self, markers: Path) -> None:
        values = ",".join(map(str, range(self.tasks)))
        command = f"command=payload.py {markers} {{i}}"
        self.jobs.append(
            self.ddpkit("submit", "spec.yaml", "--sweep", f"i={values}", "--set", command)
        )

    def separate(self, markers: Path) -> None:
        for task in range(self.tasks):
            command = f"command=payload.py {markers} {task}"
            self.jobs.append(self.ddpkit("submit", "spec.yaml", "--set", command))

    def submitit(self, markers: Path) -> None:
        import submitit

        executor = submitit.AutoExecutor(folder=self.work / "submitit", cluster="slurm")
        executor.update_parameters(
            nodes=1, tasks_per_node=1, timeout_min=5, slurm_array_parallelism=self.tasks
        )
        jobs = executor.map_array(mark_and_wait, [str(markers)] * self.tasks, range(self.tasks))
        self.jobs.append(str(jobs[0].job_id).partition("_")[0])

    def api_sweep(self, markers: Path) -> None:
        """The same sweep as ``ddpkit submit --sweep``, through the Python API: no start-up."""
        from ddpkit.jobs import api

        values = ",".join(map(str, range(self.tasks)))
        command = f"command=payload.py {markers} {{i}}"
        spec = api.load(self.work / "spec.yaml", [command], sweeps=[f"i={values}"], cwd=self.work)
        self.jobs.append(api.submit(spec).job_id)

    def map_function(self, markers: Path) -> None:
        """ddpkit's counterpart of map_array: a Python function once per run of a sweep."""
        from ddpkit.jobs import api

        values = ",".join(map(str, range(self.tasks)))
        spec = api.load(self.work / "spec.yaml", sweeps=[f"index={values}"], cwd=self.work)
        jobs = api.map_function(functools.partial(mark_and_wait, str(markers)), spec=spec)
        self.jobs.append(str(jobs[0].job_id).partition("_")[0])

    def timed(self, submit: Callable[[Path], None], round_: int, name: str) -> float:
        markers = self.work / f"markers-{round_}-{name.replace(' ', '-')}"
        markers.mkdir()
        start = time.perf_counter()
        submit(markers)
        deadline = start + ALL_RUNNING_TIMEOUT_S
        while time.perf_counter() < deadline:
            if len(os.listdir(markers)) >= self.tasks:
                elapsed = time.perf_counter() - start
                self.cancel()
                return elapsed
            time.sleep(POLL_S)
        self.cancel()
        raise SystemExit(f"{name}: not all {self.tasks} runs started in {ALL_RUNNING_TIMEOUT_S} s")

    def cancel(self) -> None:
        if self.jobs:
            subprocess.run(["scancel", *self.jobs], env=self.env, check=False)
            self.jobs = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=4, help="runs per sweep (<= 8 here)")
    parser.add_argument("--runs", type=int, default=3, help="rounds of the three variants")
    parser.add_argument("--quick", action="store_true", help="2 runs per sweep, 1 round")
    parser.add_argument("--settle-s", type=float, default=0.5)
    parser.add_argument("--slurm-env", type=Path, default=Path(DEFAULT_ENV_FILE))
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.runs = 2, 1
    env = cluster_env(args.slurm_env)
    os.environ.update(env)  # submitit runs sbatch with this process's environment
    with tempfile.TemporaryDirectory(prefix="bench-sweep-", dir=Path.cwd()) as tmp:
        bench = Bench(env, Path(tmp), args.tasks)
        sides = {
            "ddpkit sweep": bench.sweep,
            "ddpkit submit xN": bench.separate,
            "submitit map_array": bench.submitit,
            "ddpkit api.submit sweep (in process)": bench.api_sweep,
            "ddpkit map_function (in process)": bench.map_function,
        }
        times: dict[str, list[float]] = {name: [] for name in sides}
        try:
            for round_ in range(args.runs):
                first = round_ % len(VARIANTS)  # alternate who goes first
                order = VARIANTS[first:] + VARIANTS[:first]
                for name in order:
                    wait_idle(env, args.settle_s)
                    times[name].append(bench.timed(sides[name], round_, name))
        finally:
            bench.cancel()
    report(args, times)


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["ddpkit submit xN"]
    print(f"submit to all {args.tasks} runs running (median of {args.runs}):")
    for name, value in medians.items():
        runs = ", ".join(f"{v:.2f}" for v in times[name])
        print(f"  {name:38s} {value:6.2f} s  ({value / base:.2f} x separate submits)  [{runs}]")
    if args.json is not None:
        command = f"python benchmarks/bench_sweep.py --tasks {args.tasks} --runs {args.runs}"
        rows = [
            {
                "figure": f"submit to all {args.tasks} runs running",
                "variant": name,
                "value": value,
                "unit": "s",
                "higher_is_better": False,
                "x": float(args.tasks),
                "trials": times[name],  # round by round, side by side: noise vs a real gap
            }
            for name, value in medians.items()
        ]
        payload = {"bench": "sweep", "title": "Sweep submission", "command": command, "rows": rows}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
