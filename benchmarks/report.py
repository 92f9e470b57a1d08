"""Run every benchmark of the project and write a Markdown report with PNG plots.

    python benchmarks/report.py [--out benchmarks/results] [--quick]
        [--slurm-env /tmp/ddpkit-slurm/env.sh] [--only loop,eval [--merge]] [--timeout-s 600]

Every ``benchmarks/bench_*.py`` runs in turn with ``--json FILE`` (and ``--quick``), its own
way: a line ``# report-launcher: ddpkit run --nproc-per-node 2`` in the file starts it under
that launcher (default: plain ``python``); ``# report-needs: slurm`` (or a ``--slurm-env``
option) marks one that needs the test cluster (``--slurm-env`` here, or SLURM_CONF already
set; otherwise "not run: no cluster").
A new bench joins the report by following that protocol, without a change here. The output:
``OUT/REPORT.md`` (the machine, one table per bench with every figure's ratio to its baseline
and a verdict saying where ddpkit is behind, with the why from ``benchmarks/why.yaml``),
``OUT/<bench>.png`` and ``OUT/results.json`` (every bench's outcome and figures, the machine:
``--render-only`` rewrites the report from it, e.g. after editing why.yaml; ``--only X --merge``
re-runs X and keeps the others' outcomes, the command line saying which ran when), and each bench's
output in ``OUT/logs/``. A failing bench is reported with its stderr's tail; the exit code is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from report_render import (
    STDERR_LINES,
    Outcome,
    check_document,
    mark_references,
    plot,
    render_markdown,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LAUNCHER = re.compile(r"^# report-launcher:\s*(.+?)\s*$", re.MULTILINE)
NEEDS = re.compile(r"^# report-needs:\s*(.+?)\s*$", re.MULTILINE)
PEERS = ["accelerate", "lightning-fabric", "matplotlib"]


def declared(path: Path) -> tuple[list[str], set[str]]:
    """The bench's launcher (argv before the script) and what it needs, from its comments."""
    text = path.read_text()
    launcher = LAUNCHER.search(text)
    words = shlex.split(launcher.group(1)) if launcher else ["python"]
    if words[0] == "python":
        words = [sys.executable, *words[1:]]
    elif words[0] == "ddpkit":  # the worktree's ddpkit, whatever console script is on PATH
        words = [sys.executable, "-m", "ddpkit", *words[1:]]
    needs = {word.strip() for found in NEEDS.finditer(text) for word in found.group(1).split(",")}
    if '"--slurm-env"' in text:  # a bench with a --slurm-env option runs on the test cluster
        needs.add("slurm")
    return words, needs


def cluster_env(slurm_env: Path | None, environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment for SLURM benches (the env file's exports added), or None: no cluster."""
    env = dict(environ)
    if slurm_env is None:
        return env if env.get("SLURM_CONF") else None
    if not slurm_env.is_file():
        return None
    for line in slurm_env.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, _, value = words[1].partition("=")
            env[key] = value
    env["DDPKIT_TEST_SLURM_ENV"] = str(slurm_env)
    return env


def run_bench(
    path: Path, out: Path, *, quick: bool, timeout_s: float, env: Mapping[str, str] | None,
    slurm: Mapping[str, str] | None,
) -> Outcome:  # fmt: skip
    name = path.stem
    launcher, needs = declared(path)
    if "slurm" in needs and slurm is None:
        return Outcome(name, "not run", reason="no cluster (give --slurm-env)")
    child = dict(slurm if "slurm" in needs and slurm is not None else env or os.environ)
    child["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [child.get("PYTHONPATH")])]
    )
    with tempfile.TemporaryDirectory(prefix="ddpkit-report-") as tmp:
        result = Path(tmp) / f"{name}.json"
        argv = [*launcher, str(path), "--json", str(result), *(["--quick"] if quick else [])]
        start = time.monotonic()
        code, stdout, stderr = _run_bounded(argv, child, timeout_s)
        seconds = time.monotonic() - start
        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{name}.log").write_text(f"$ {shlex.join(argv)}\n{stdout}\n--- stderr\n{stderr}")
        tail = "\n".join((stderr or stdout).splitlines()[-STDERR_LINES:])
        if code is None:
            return Outcome(name, "failed", seconds, f"timed out after {timeout_s:.0f} s", tail)
        if code != 0:
            return Outcome(name, "failed", seconds, f"exit code {code}", tail)
        try:
            doc = json.loads(result.read_text())
        except (OSError, ValueError) as error:
            return Outcome(name, "failed", seconds, f"no readable --json output ({error})", tail)
    problem = check_document(doc)
    if problem:
        return Outcome(name, "failed", seconds, f"bad --json output: {problem}", tail)
    output = "\n".join(stdout.splitlines()[-STDERR_LINES:])
    return Outcome(name, "ok", seconds, doc=doc, output_tail=output)


def device_outcomes(out: Path) -> list[Outcome]:
    """The figures measured on a lent GPU machine (``ci/gpu-check.sh`` writes them with
    ``--json``), kept in ``OUT/device/<name>.json`` with the device in their title: the report
    shows them beside this machine's, as measured there, never re-run or altered here."""
    found = []
    for path in sorted((out / "device").glob("*.json")):
        doc = json.loads(path.read_text())
        problem = check_document(doc)
        name = f"device_{path.stem}"  # e.g. device_loop-h100
        if problem:
            found.append(Outcome(name, "failed", reason=f"bad {path.name}: {problem}"))
        else:
            found.append(Outcome(name, "ok", doc=doc))
    return found


def _run_bounded(
    argv: list[str], env: Mapping[str, str], timeout_s: float
) -> tuple[int | None, str, str]:
    """Run a bench in a session of its own: (exit code, None past the timeout; stdout; stderr).

    Past the timeout the whole process group is killed, not only the bench: a bench's own
    children (bench_scale's rank holders, a launcher's workers) would otherwise go on loading
    the machine after the report moved on."""
    process = subprocess.Popen(
        argv, cwd=ROOT, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return None, _text(stdout), _text(stderr)
    finally:
        with contextlib.suppress(ProcessLookupError):  # leftovers of a bench that ended
            os.killpg(process.pid, signal.SIGKILL)


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def machine(started: datetime.datetime, load: tuple[float, float]) -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE).group(1)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        pass
    versions = {"torch": "?", **dict.fromkeys(PEERS, "not installed")}
    for package in versions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "CPU": f"{cpu}, {os.cpu_count()} cores",
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        **{package: version for package, version in versions.items()},
        "load average (1 min) at start / end": f"{load[0]:.2f} / {load[1]:.2f}",
    }


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--quick", action="store_true", help="every bench's short run")
    parser.add_argument("--slurm-env", type=Path, default=None, help="the test cluster's env.sh")
    parser.add_argument("--only", default="", help="comma-separated names, e.g. loop,eval")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per bench")
    parser.add_argument("--benchmarks", type=Path, default=HERE, help=argparse.SUPPRESS)
    parser.add_argument("--why", type=Path, default=HERE / "why.yaml", help="the why notes")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: rewrite REPORT.md and the plots from OUT/results.json (after editing "
        "why.yaml, say)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --only: keep OUT/results.json's other benches and replace only these (the "
        "report's command line then says which ran when, at what load)",
    )
    args = parser.parse_args(argv)
    if args.merge and not args.only:
        parser.error("--merge: give --only the benches to re-run (e.g. --only scale --merge)")
    environ = os.environ if environ is None else environ
    notes = yaml.safe_load(args.why.read_text()) if args.why.is_file() else {}
    if args.render_only:
        saved = json.loads((args.out / "results.json").read_text())
        outcomes = [
            Outcome(**fields) for fields in saved["outcomes"] if "device" not in fields["name"]
        ]
        outcomes += device_outcomes(args.out)
        return write(args.out, outcomes, saved["machine"], saved["command"], notes)
    benches = sorted(args.benchmarks.glob("bench_*.py"))
    only = {name.strip().removeprefix("bench_") for name in args.only.split(",") if name.strip()}
    unknown = only - {path.stem.removeprefix("bench_") for path in benches}
    if unknown:
        parser.error(f"--only: no bench named {sorted(unknown)} in {args.benchmarks}")
    benches = [path for path in benches if not only or path.stem.removeprefix("bench_") in only]
    args.out.mkdir(parents=True, exist_ok=True)
    slurm = cluster_env(args.slurm_env, environ)
    started, load = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()[0]

    outcomes = []
    for path in benches:
        print(f"report: {path.name} ...", file=sys.stderr, flush=True)
        outcome = run_bench(
            path, args.out, quick=args.quick, timeout_s=args.timeout_s, env=environ, slurm=slurm
        )
        print(f"report: {path.name}: {outcome.status} {outcome.reason} ({outcome.seconds:.0f} s)",
              file=sys.stderr, flush=True)  # fmt: skip
        outcomes.append(outcome)
    shown = ["python", "benchmarks/report.py", *(argv if argv is not None else sys.argv[1:])]
    about = machine(started, (load, os.getloadavg()[0]))
    command = shlex.join(shown)
    if args.merge and (args.out / "results.json").is_file():
        earlier = json.loads((args.out / "results.json").read_text())
        fresh = {outcome.name for outcome in outcomes}
        kept = [Outcome(**fields) for fields in earlier["outcomes"]
                if fields["name"] not in fresh and "device" not in fields["name"]]  # fmt: skip
        order = {fields["name"]: n for n, fields in enumerate(earlier["outcomes"])}
        outcomes = sorted(kept + outcomes, key=lambda o: order.get(o.name, len(order)))
        command = (
            f"{earlier['command']}; then re-run on {about['date']} (load "
            f"{about['load average (1 min) at start / end']}) with --only {args.only}"
        )
        about = earlier["machine"]
    outcomes += device_outcomes(args.out)
    saved = {"machine": about, "command": command, "outcomes": outcomes}
    (args.out / "results.json").write_text(json.dumps(saved, indent=1, default=vars) + "\n")
    return write(args.out, outcomes, about, command, notes)


def write(
    out: Path, outcomes: list[Outcome], about: dict[str, str], command: str,
    notes: Mapping[str, Any],
) -> int:  # fmt: skip
    """REPORT.md and one PNG per bench with figures; 1 when a bench failed, else 0."""
    plots = {}
    for outcome in outcomes:
        if outcome.status == "ok" and outcome.doc["rows"]:
            plot(mark_references(outcome.doc, notes), out / f"{outcome.name}.png")
            plots[outcome.name] = f"{outcome.name}.png"
    (out / "REPORT.md").write_text(render_markdown(outcomes, about, command, notes, plots))
    failed = [outcome.name for outcome in outcomes if outcome.status == "failed"]
    print(
        f"report: wrote {out / 'REPORT.md'}" + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
