"""``python -m ddpkit.cluster.stop.health --timeout-s T -- CHECK``: a job spec's health check on
one node, reported as one line of JSON.

The batch script (a spec with ``health_check:``) runs this once per node at the start of each
attempt, and again after the job's step failed, and pipes every node's line to :mod:`.exclude`,
which blames the nodes that failed or did not answer. ``CHECK``, the spec's shell line, runs as
``bash -c CHECK``; its output goes to the job's log (stderr), prefixed with the node's name,
and its last line is the reason given when it fails. Bounded: the check's process group is
killed after ``T`` seconds. The stop signal is blocked for the check (it stays pending): a
warning that comes meanwhile must not fail a healthy node.

The report, on stdout: ``{"ddpkit_health": 1, "node": "n1", "ok": false, "why": "..."}``.
The node is ``SLURMD_NODENAME`` (SLURM's name for it, what ``ExcNodeList`` takes), else the
host name. Exit code 0 whatever the check did (the report says it); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

from ddpkit.cluster.stop.signals import stop_signal

__all__ = ["REPORT_KEY", "check_node", "main", "node_name", "report_line"]

REPORT_KEY = "ddpkit_health"  # marks a report among other lines of srun's output
_WHY_CHARS = 200  # of the check's last line, in the report and the log


def node_name(env: Mapping[str, str]) -> str:
    """SLURM's name for this node (``SLURMD_NODENAME``), else the host name."""
    return env.get("SLURMD_NODENAME", "").strip() or socket.gethostname()


def report_line(node: str, why: str | None) -> str:
    """One report: ``why`` None when the check passed."""
    return json.dumps({REPORT_KEY: 1, "node": node, "ok": why is None, "why": why})


def _printable(text: str) -> str:
    """``text`` without control characters, shortened: it goes into one log line."""
    cleaned = "".join(char if char.isprintable() else "?" for char in text.strip())
    return cleaned if len(cleaned) <= _WHY_CHARS else cleaned[: _WHY_CHARS - 3] + "..."


def check_node(check: str, timeout_s: float, *, node: str) -> str | None:
    """Run ``bash -c check``; None when it exits 0, else why it failed (its output goes to
    stderr, each line prefixed with ``node``)."""
    try:
        child = subprocess.Popen(
            ["bash", "-c", check],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: a timeout kills what it started too
        )
    except OSError as exc:
        return f"could not start bash: {exc}"
    try:
        output, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        _echo(node, output)
        return f"timed out after {timeout_s:g} s"
    _echo(node, output)
    if child.returncode == 0:
        return None
    last = [line for line in output.decode(errors="replace").splitlines() if line.strip()]
    said = f": {_printable(last[-1])}" if last else ""
    if child.returncode < 0:
        return f"killed by {signal.Signals(-child.returncode).name}{said}"
    return f"exit code {child.returncode}{said}"


def _echo(node: str, output: bytes) -> None:
    for line in output.decode(errors="replace").splitlines():
        print(f"ddpkit health check [{node}]: {line}", file=sys.stderr)
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("check", nargs=1, help="the shell line to run (after --)")
    args = parser.parse_args(argv)
    if not args.timeout_s > 0:
        parser.error(f"--timeout-s {args.timeout_s!r} must be > 0")
    # Blocked in this process and so in the check (it stays pending): SLURM's warning or a
    # `scancel --signal` must not fail the node. Not the job's TERM: scancel still ends both.
    signal.pthread_sigmask(signal.SIG_BLOCK, [stop_signal(os.environ, lenient=True)])
    node = node_name(os.environ)
    why = check_node(args.check[0], args.timeout_s, node=node)
    print(report_line(node, why), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
