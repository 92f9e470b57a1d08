"""How long a finished 2-rank job takes to exit, under ``ddpkit.init()`` and under plain torch.

    python benchmarks/bench_exit.py [--runs 9] [--json FILE] [--quick]

Each run is the 2-rank gloo job of :mod:`exit_race` (one all-reduce, then the script ends;
peer bound: the default) with no offset, ranks forked from one parent that imported torch and
ddpkit once. Its exit time: from the later rank's end of the script to both ranks reaped (the
at-exit steps and the interpreter's finalization). Runs alternate plain torch
(``init_process_group``) and ddpkit; the medians and their difference are printed
(goal: ddpkit within 1 s of plain torch). ``--json`` writes the medians for
``benchmarks/report.py``; ``--quick`` makes 3 runs of each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchjson
import exit_race


def one_exit(plain: bool, folder: Path) -> float:
    """Seconds from the later rank's end of the script to both ranks reaped."""
    exit_race.PLAIN[0] = plain
    port = exit_race.free_port()
    errs = [folder / f"rank{rank}.err" for rank in (0, 1)]
    ends = [folder / f"rank{rank}.end" for rank in (0, 1)]
    for end in ends:
        end.unlink(missing_ok=True)
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                exit_race.rank_main(rank, port, 0.0, errs[rank])
                ends[rank].write_text(repr(time.monotonic()))  # CLOCK_MONOTONIC: system-wide
            except BaseException:
                code = 1
            sys.exit(code)  # through the interpreter's finalization, as a script ends
        pids.append(pid)
    for rank, pid in enumerate(pids):
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"rank {rank} failed: {errs[rank].read_text()[-2000:]}")
    reaped = time.monotonic()
    return reaped - max(float(end.read_text()) for end in ends)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="runs of each, alternating")
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.runs = 3
    folder = Path(tempfile.mkdtemp())  # no context manager: a child unwinds through here
    parent = os.getpid()
    times: dict[str, list[float]] = {"plain torch": [], "ddpkit": []}
    try:
        for run in range(args.runs):
            order = ["plain torch", "ddpkit"] if run % 2 == 0 else ["ddpkit", "plain torch"]
            for name in order:
                times[name].append(one_exit(name == "plain torch", folder))
    finally:
        if os.getpid() == parent:
            shutil.rmtree(folder, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        shown = " ".join(f"{value:.2f}" for value in values)
        print(f"{name:12} exit median {medians[name]:.2f} s  ({shown})")
    extra = medians["ddpkit"] - medians["plain torch"]
    print(f"ddpkit - plain torch: {extra:+.2f} s (goal: <= 1 s), {args.runs} runs each")
    figure = "a finished 2-rank gloo job: from the later rank's end of the script to both reaped"
    rows = [
        benchjson.row(figure, name, medians[name], "s", False, trials=times[name])
        for name in ("ddpkit", "plain torch")
    ]
    rows[-1]["baseline"] = True
    title = "Exit: a finished job's exit, ddpkit.init() against plain torch"
    benchjson.write(args.json, "exit", title, "python", rows)


if __name__ == "__main__":
    main()
