"""Launcher overhead: `ddpkit run` vs `torchrun` and `accelerate launch`; `ddpkit --help`.

    python benchmarks/bench_launch.py [--runs 7] [--quick] [--json FILE]

Every launcher starts the same trivial 2-process gloo script (benchmarks/trivial.py), in turn,
the first one rotating from run to run, and the wall time of each whole command is taken; the
medians and the ratio ddpkit / torchrun are printed (goal: <= 1.05). `accelerate launch`
(``--multi_gpu --num_processes 2``: torchrun's agent underneath, on CPU too) runs when
Accelerate is installed (``pip install ddpkit[bench]``); otherwise a note says so. Then
`ddpkit --help` is timed (goal: < 0.3 s) beside a bare Python start-up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import benchjson

HERE = Path(__file__).resolve().parent
TRIVIAL = HERE / "trivial.py"
ACCELERATE_ARGS = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
ACCELERATE_ARGS += ["--mixed_precision", "no", "--dynamo_backend", "no"]


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def tool(name: str) -> list[str]:
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"{name!r} is not on PATH; install ddpkit (pip install -e .) first")
    return [found]


def launchers() -> tuple[dict[str, list[str]], list[str]]:
    commands = {
        "torchrun": [*tool("torchrun"), "--nproc-per-node", "2", str(TRIVIAL)],
        "ddpkit run": [*tool("ddpkit"), "run", "--nproc-per-node", "2", str(TRIVIAL)],
    }
    accelerate = shutil.which("accelerate")
    if accelerate is None:
        return commands, ["accelerate launch: not installed (pip install ddpkit[bench])"]
    commands["accelerate launch"] = [accelerate, "launch", *ACCELERATE_ARGS, str(TRIVIAL)]
    return commands, []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun warns (and sets it) otherwise

    commands, notes = launchers()
    names = list(commands)
    for name in names:  # warm the page cache for each
        wall(commands[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.runs):
        shift = i % len(names)  # rotate which goes first
        for name in names[shift:] + names[:shift]:
            times[name].append(wall(commands[name]))
        print(f"run {i}: " + "   ".join(f"{name} {times[name][-1]:.3f} s" for name in names))
    median = {name: statistics.median(times[name]) for name in names}
    a, b = median["torchrun"], median["ddpkit run"]
    print(f"median: torchrun {a:.3f} s, ddpkit run {b:.3f} s, ratio {b / a:.3f} (goal <= 1.05)")
    if "accelerate launch" in median:
        c = median["accelerate launch"]
        print(f"median: accelerate launch {c:.3f} s, ratio ddpkit run / accelerate {b / c:.3f}")
    for note in notes:
        print(note)

    helps = statistics.median(wall([*tool("ddpkit"), "--help"]) for _ in range(args.runs))
    bare = statistics.median(wall([sys.executable, "-c", "0"]) for _ in range(args.runs))
    print(
        f"ddpkit --help: median {helps:.3f} s over {args.runs} runs (goal < 0.3 s; "
        f"a bare python start-up here: {bare:.3f} s)"
    )
    figure = f"launch a trivial 2-process gloo job (median of {args.runs})"
    rows = [
        benchjson.row(figure, name, median[name], "s", False, trials=times[name]) for name in names
    ]
    rows.append(benchjson.row("ddpkit --help (goal < 0.3 s)", "ddpkit --help", helps, "s", False))
    notes.append(f"ddpkit --help: a bare `python -c 0` takes {bare:.3f} s on this machine")
    title = "Launch: ddpkit run vs torchrun and accelerate launch"
    benchjson.write(args.json, "launch", title, "python", rows, notes=notes)


if __name__ == "__main__":
    main()
