"""Print the slowest tests of one or more pytest runs, from the files that tests/conftest.py's
``--times-file`` writes (one JSON line per test: wall seconds and CPU seconds, pytest's own and
its reaped children's), with each run's totals and the files that cost the most CPU.

    python3 ci/slowest.py [-n 20] [--files 12] [--jobs SACCT_FILE] NAME=TIMES_FILE ...

ci/test.sh calls it at the end of every run with its two pytest runs. The SLURM run's CPU in
pytest misses the processes of the SLURM jobs (slurmd starts them, not pytest), which cost more
than the rest of that run: ``--jobs`` reads ``sacct -a --duplicates -n -P -o
JobID,JobName,TotalCPU,WorkDir`` taken before the cluster stops and prints their total and the
folders whose jobs cost the most (a job's folder is its test's ``tmp_path`` or a module
fixture's folder, named after the test or the case). sacct's TotalCPU misses what a step
killed by a signal had used, so the figure is a floor. A missing or empty file is reported and
skipped: a run that ended before its first test still gets its phase table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple


class Row(NamedTuple):
    run: str
    test: str
    wall: float
    cpu: float  # pytest's own process
    children: float  # the children it reaped
    outcome: str  # passed, failed, skipped (its worst phase's)


def _read(run: str, path: Path) -> list[Row]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
            wall, cpu, children = float(r["wall"]), float(r["cpu"]), float(r["cpu_children"])
            rows.append(Row(run, str(r["test"]), wall, cpu, children, str(r.get("outcome", "?"))))
        except (ValueError, TypeError, KeyError):  # a line cut short by a killed run
            continue
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("-n", type=int, default=20, help="how many tests to list (default 20)")
    ap.add_argument("--files", type=int, default=12, help="how many files to list (default 12)")
    ap.add_argument("--jobs", type=Path, help="sacct's lines for the SLURM jobs' CPU (see above)")
    ap.add_argument("runs", nargs="+", metavar="NAME=TIMES_FILE")
    args = ap.parse_args(argv)
    if args.jobs:
        _jobs(args.jobs, args.files)
    tests: list[Row] = []
    for spec in args.runs:
        name, sep, file = spec.partition("=")
        if not sep:
            ap.error(f"run {spec!r}: expected NAME=TIMES_FILE")
        path = Path(file)
        rows = _read(name, path) if path.is_file() else []
        if not rows:
            print(f"slowest: run {name!r}: no test times in {file}")
            continue
        failed = sum(r.outcome == "failed" for r in rows)
        print(
            f"== {name}: {len(rows)} tests ({failed} failed), {sum(r.wall for r in rows):.0f} s "
            "of test wall time "
            f"(summed over its workers), CPU {sum(r.cpu for r in rows):.0f} s in pytest + "
            f"{sum(r.children for r in rows):.0f} s in its children"
        )
        tests += rows
    if not tests:
        return 0
    print(f"== the {args.n} slowest tests (wall s: setup+call+teardown; CPU s: pytest + children)")
    for r in sorted(tests, key=lambda r: -r.wall)[: args.n]:
        mark = " (failed)" if r.outcome == "failed" else ""
        print(f"  {r.wall:7.1f}  cpu {r.cpu:6.1f} + {r.children:6.1f}  {r.run:6}  {r.test}{mark}")
    files: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in tests:
        f = files[(r.run, r.test.split("::")[0])]
        f[0] += r.cpu + r.children
        f[1] += r.wall
        f[2] += 1
    print(f"== the {args.files} files that cost the most CPU (CPU s, wall s, tests)")
    top = sorted(files.items(), key=lambda kv: -kv[1][0])[: args.files]
    for (run, file), (cpu, wall, n) in top:
        print(f"  {cpu:7.0f}  {wall:7.0f}  {n:5.0f}  {run:6}  {file}")
    return 0


def _seconds(total_cpu: str) -> float:
    """sacct's TotalCPU, ``[D-][HH:]MM:SS[.mmm]``, in seconds."""
    days, _, clock = total_cpu.rpartition("-")
    seconds = 0.0
    for part in clock.split(":"):
        seconds = seconds * 60 + float(part)
    return seconds + 86400 * int(days or 0)


def _jobs(path: Path, top: int) -> None:
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    folders: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for line in lines:
        fields = line.split("|")
        if len(fields) < 4 or "." in fields[0]:  # a job's line sums its steps' lines
            continue
        try:
            cpu = _seconds(fields[2])
        except ValueError:
            continue
        parts = Path(fields[3]).parts  # .../pytest-N/popen-gwK/<folder>/... or the folder itself
        at = next((i for i, p in enumerate(parts) if p.startswith("popen-gw")), None)
        folder = parts[at + 1] if at is not None and len(parts) > at + 1 else fields[1]
        folders[folder][0] += cpu
        folders[folder][1] += 1
    if not folders:
        print(f"slowest: no SLURM job lines in {path}")
        return
    total = sum(cpu for cpu, _ in folders.values())
    runs = sum(n for _, n in folders.values())
    print(f"== the SLURM jobs: {runs:.0f} runs, {total:.0f} CPU-s (sacct TotalCPU, a floor)")
    print(f"== the {top} job folders that cost the most CPU (CPU s, runs)")
    for folder, (cpu, n) in sorted(folders.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {cpu:7.0f}  {n:5.0f}  {folder}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
