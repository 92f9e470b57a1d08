"""The JSON every ``bench_*.py`` writes with ``--json FILE``, for ``benchmarks/report.py``.

    {"bench": "<short name>", "title": "...", "command": "<reproducing command>",
     "rows": [{"figure": ..., "variant": ..., "value": <float>, "unit": ...,
               "higher_is_better": <bool>, "x": <optional float>,
               "trials": [<optional: the value of each trial, in the order they ran>]}],
     "notes": ["<optional: e.g. 'accelerate: not installed'>"]}

A variant whose name starts with ``ddpkit`` is ddpkit's side of a figure; the others are its
baselines (``"baseline": true`` names the one ratios are taken against, even a ddpkit
variant such as N separate submits beside one sweep), except rows with ``"reference": true``
(what the link or the hardware does alone, e.g. a raw socket: shown, never a baseline ddpkit
is "behind"). ``trials``, when the variants
of a figure ran side by side trial after trial, lets the report tell a consistent gap from
noise. ``notes`` is optional (the report prints it under the bench's table).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "command", "row", "write"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json FILE`` and ``--quick`` (a run of well under a minute, for the report's tests)."""
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write figures")
    parser.add_argument("--quick", action="store_true", help="a short run (well under a minute)")


def command(launcher: str = "python") -> str:
    """The command line that reproduces this run: ``launcher`` + this script + its arguments
    (less ``--json FILE``), with the script's path relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    root = script.parents[1]
    args: list[str] = []
    skip = False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if arg == "--json":
            skip = True
            continue
        if arg.startswith("--json="):
            continue
        args.append(arg)
    shown = str(script.relative_to(root)) if script.is_relative_to(root) else str(script)
    return " ".join([launcher, shlex.quote(shown), *map(shlex.quote, args)])


def row(
    figure: str,
    variant: str,
    value: float,
    unit: str,
    higher_is_better: bool,
    *,
    x: float | None = None,
    reference: bool = False,
    trials: list[float] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "figure": figure,
        "variant": variant,
        "value": float(value),
        "unit": unit,
        "higher_is_better": higher_is_better,
    }
    if x is not None:
        out["x"] = float(x)
    if reference:
        out["reference"] = True
    if trials:
        out["trials"] = [float(value) for value in trials]
    return out


def write(
    path: Path | None,
    bench: str,
    title: str,
    launcher: str,
    rows: list[dict[str, Any]],
    *,
    notes: list[str] | None = None,
) -> None:
    """Write the figures to ``path`` (nothing when ``--json`` was not given)."""
    if path is None:
        return
    document: dict[str, Any] = {
        "bench": bench,
        "title": title,
        "command": command(launcher),
        "rows": rows,
    }
    if notes:
        document["notes"] = notes
    path.write_text(json.dumps(document, indent=1) + "\n")
