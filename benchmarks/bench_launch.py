"""Launcher overhead: `ddpkit run` vs `torchrun`, and the start-up time of `ddpkit --help`.

    python benchmarks/bench_launch.py [--runs 7]

Both launchers start the same trivial 2-process gloo script (benchmarks/trivial.py), alternately,
and the wall time of each whole command is taken; the medians and the ratio ddpkit / torchrun
are printed (goal: <= 1.05). Then `ddpkit --help` is timed (goal: < 0.3 s).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRIVIAL = HERE / "trivial.py"


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def tool(name: str) -> list[str]:
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"{name!r} is not on PATH; install ddpkit (pip install -e .) first")
    return [found]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    torchrun = [*tool("torchrun"), "--nproc-per-node", "2", str(TRIVIAL)]
    ddpkit_run = [*tool("ddpkit"), "run", "--nproc-per-node", "2", str(TRIVIAL)]
    wall(torchrun)  # warm the page cache for both
    wall(ddpkit_run)
    t_torch: list[float] = []
    t_kit: list[float] = []
    for i in range(args.runs):
        if i % 2:  # alternate which goes first
            t_kit.append(wall(ddpkit_run))
            t_torch.append(wall(torchrun))
        else:
            t_torch.append(wall(torchrun))
            t_kit.append(wall(ddpkit_run))
        print(f"run {i}: torchrun {t_torch[-1]:.3f} s   ddpkit run {t_kit[-1]:.3f} s")
    a, b = statistics.median(t_torch), statistics.median(t_kit)
    print(f"median: torchrun {a:.3f} s, ddpkit run {b:.3f} s, ratio {b / a:.3f} (goal <= 1.05)")

    helps = statistics.median(wall([*tool("ddpkit"), "--help"]) for _ in range(args.runs))
    bare = statistics.median(wall([sys.executable, "-c", "0"]) for _ in range(args.runs))
    print(
        f"ddpkit --help: median {helps:.3f} s over {args.runs} runs (goal < 0.3 s; "
        f"a bare python start-up here: {bare:.3f} s)"
    )


if __name__ == "__main__":
    main()
