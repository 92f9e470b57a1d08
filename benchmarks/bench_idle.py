"""A launcher's own CPU while its workers compute: `ddpkit run` vs `torchrun`, at 2 and 8 ranks.

    python benchmarks/bench_idle.py [--runs 3] [--ranks 2,8] [--sleep-s 20] [--quick] [--json FILE]

Each launcher starts the same worker (benchmarks/idle_worker.py: join a gloo group, print a
line, sleep ``--sleep-s``, exit), in turn, the first one alternating from run to run. Once every
worker has joined its group (each writes a file then), the launcher's CPU time (user + system,
all its threads: ``/proc/<pid>/stat``) and that of its other children (ddpkit's sweeper; the
workers are not counted) is read at the start and at the end of a window of ``--sleep-s`` less
3 s, and printed as a share of one core. Goal: ``ddpkit run`` at most 0.5 % of a core above
torchrun's, at 2 and at 8 ranks.

``ddpkit run`` is ``python -m ddpkit run`` (the ddpkit on ``PYTHONPATH``, or installed) with
its defaults (a c10d rendezvous on a free port, every worker line tee'd and prefixed); torchrun
is ``python -m torch.distributed.run`` with its own defaults (a static rendezvous, here on a free
port so that runs on a shared machine do not collide; workers write to the terminal). Linux only
(``/proc``); a tick of ``/proc/<pid>/stat`` is 10 ms, 0.07 % of a 15-s window.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchjson

HERE = Path(__file__).resolve().parent
WORKER = HERE / "idle_worker.py"
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
GOAL_PERCENT = 0.5
START_BOUND_S = 300.0  # the slowest start seen of 8 ranks on this 2-core machine is ~60 s


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (every thread, also those that ended)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime (fields 14, 15)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                found.append(int(entry.name))
    return found


def helpers(pid: int) -> list[int]:
    """The launcher's children that are not workers (ddpkit's sweeper)."""
    kept = []
    for child in children(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if str(WORKER).encode() not in command:
            kept.append(child)
    return kept


def launcher_cpu_s(pid: int, others: list[int]) -> float:
    total = cpu_s(pid)
    for other in others:
        with contextlib.suppress(OSError):  # it ended
            total += cpu_s(other)
    return total


def command(name: str, ranks: int) -> list[str]:
    if name == "torchrun":
        port = ["--master-port", str(free_port())]
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", *port]
    return [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", str(ranks)]


def idle_percent(name: str, ranks: int, sleep_s: float) -> float:
    """One run: the launcher's share of a core while its ``ranks`` workers sleep."""
    window_s = sleep_s - 3.0
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as scratch:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "IDLE_READY_DIR": scratch}
        env["IDLE_SLEEP_S"] = str(sleep_s)
        argv = [*command(name, ranks), str(WORKER)]
        process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + START_BOUND_S
            while len(os.listdir(scratch)) < ranks:
                if process.poll() is not None or time.monotonic() > deadline:
                    err = process.stderr.read().decode(errors="replace") if process.stderr else ""
                    raise SystemExit(f"{name}: the workers did not start:\n{err[-3000:]}")
                time.sleep(0.05)
            time.sleep(1.0)  # the last prints tee'd, the agent in its monitor loop
            others = helpers(process.pid)
            before, started = launcher_cpu_s(process.pid, others), time.monotonic()
            time.sleep(window_s)
            used, took = launcher_cpu_s(process.pid, others) - before, time.monotonic() - started
            if process.poll() is not None:
                raise SystemExit(f"{name}: ended inside the window; give a longer --sleep-s")
            _, err = process.communicate(timeout=sleep_s + 120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    if process.returncode != 0:
        raise SystemExit(f"{name}: exit code {process.returncode}:\n{err.decode()[-3000:]}")
    return 100.0 * used / took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ranks", default="2,8", help="comma-separated rank counts")
    parser.add_argument("--sleep-s", type=float, default=20.0)
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.ranks, args.sleep_s = 1, "2", 10.0
    names = ["torchrun", "ddpkit run"]
    rows, verdicts = [], []
    for ranks in [int(part) for part in args.ranks.split(",")]:
        shares: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.runs):
            order = names if i % 2 == 0 else names[::-1]  # alternate which goes first
            for name in order:
                shares[name].append(idle_percent(name, ranks, args.sleep_s))
            print(f"{ranks} ranks, run {i}: " + "   ".join(
                f"{name} {shares[name][-1]:.2f} %" for name in names
            ), flush=True)  # fmt: skip
        median = {name: statistics.median(shares[name]) for name in names}
        extra = median["ddpkit run"] - median["torchrun"]
        verdict = "meets" if extra <= GOAL_PERCENT else "MISSES"
        verdicts.append(
            f"{ranks} ranks: median torchrun {median['torchrun']:.2f} %, ddpkit run "
            f"{median['ddpkit run']:.2f} % of a core: +{extra:.2f} % ({verdict} the goal "
            f"<= +{GOAL_PERCENT} %)"
        )
        print(verdicts[-1], flush=True)
        figure = f"launcher CPU while {ranks} workers sleep (% of a core, median of {args.runs})"
        rows += [
            benchjson.row(figure, name, median[name], "%", False, x=ranks, trials=shares[name])
            for name in names
        ]
    title = "Idle launcher: ddpkit run vs torchrun, its own CPU while the workers compute"
    benchjson.write(args.json, "idle", title, "python", rows, notes=verdicts)


if __name__ == "__main__":
    main()
