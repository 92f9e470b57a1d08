"""The benchmark report's renderer: bench outcomes (the JSON of ``benchjson``) to Markdown + PNGs.

Pure apart from writing the PNG files: ``render_markdown`` returns text, ``plot`` writes one
PNG per bench (bars per figure; a line per variant over ``x`` for sweeps). ``benchmarks/
report.py`` runs the benches and calls these; the tests feed them small JSON documents.

In each figure (and at each ``x`` of a sweep) the baseline is the row marked ``baseline``, else
the ``plain torch`` row, else the first row that is not ddpkit's; every row's ratio is its
value over the baseline's. ddpkit's rows (variants starting with ``ddpkit``, but for a marked
baseline) are compared with every other row but references: when one is better, the figure
says ddpkit is behind, with the note for it from the hand-edited ``why.yaml`` (bench name ->
figure substring -> why); or "level, within noise" when the gap is at most ``NOISE``, or when
the rows carry per-trial values (``trials``, run side by side) and ddpkit was the worse one in
fewer than ``CONSISTENT`` of the trials.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NOISE = 0.02  # a gap this small is within run-to-run noise on a shared 2-core machine
CONSISTENT = 0.8  # with per-trial values, "behind" needs ddpkit worse in this share of trials
STDERR_LINES = 15
REQUIRED = {"figure": "string", "variant": "string", "value": "number", "unit": "string"}


@dataclass
class Outcome:
    """One bench of the report: ``ok`` (with its document), ``failed`` or ``not run``."""

    name: str  # e.g. "bench_loop"
    status: str
    seconds: float = 0.0
    reason: str = ""  # why it failed or was not run
    stderr_tail: str = ""
    doc: dict[str, Any] = field(default_factory=dict)
    output_tail: str = ""  # the end of its output: shown when it made no figures


def check_document(doc: object) -> str:
    """'' when ``doc`` follows the protocol, else what is wrong with it (one line)."""
    if not isinstance(doc, dict):
        return "the JSON is not an object"
    for key in ("bench", "title", "command", "rows"):
        if key not in doc:
            return f"the JSON has no {key!r}"
    if not isinstance(doc["rows"], list):
        return "'rows' is not a list"
    for number, row in enumerate(doc["rows"]):
        if not isinstance(row, dict):
            return f"row {number} is not an object"
        for key, kind in REQUIRED.items():
            value = row.get(key)
            fits = isinstance(value, str) if kind == "string" else isinstance(value, int | float)
            if not fits or isinstance(value, bool):
                return f"row {number}: {key!r} is missing or not a {kind}"
        if not isinstance(row.get("higher_is_better"), bool):
            return f"row {number}: 'higher_is_better' is missing or not a bool"
        if "x" in row and not isinstance(row["x"], int | float):
            return f"row {number}: 'x' is not a number"
        trials = row.get("trials", [])
        if not isinstance(trials, list) or not all(isinstance(t, int | float) for t in trials):
            return f"row {number}: 'trials' is not a list of numbers"
    return ""


def is_ddpkit(variant: str) -> bool:
    return variant.lower().startswith("ddpkit")


def ours(row: Mapping[str, Any]) -> bool:
    """ddpkit's side of a figure: a ddpkit variant not marked as the figure's baseline."""
    return is_ddpkit(row["variant"]) and not row.get("baseline")


def competes(row: Mapping[str, Any]) -> bool:
    """A baseline ddpkit is measured against: not ddpkit's, not a reference (a link's ceiling)."""
    return not ours(row) and not row.get("reference")


def mark_references(doc: Mapping[str, Any], notes: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``doc`` whose rows matching why.yaml's ``_references`` say ``reference: true``
    and those matching ``_baselines`` (a ddpkit variant that is the figure's plain baseline,
    e.g. N separate ``ddpkit submit`` calls beside one sweep) say ``baseline: true``."""

    def marks(key: str) -> list[str]:
        return [str(name).lower() for name in notes.get(key) or []]

    references, baselines = marks("_references"), marks("_baselines")
    rows = []
    for row in doc.get("rows", []):
        variant = row["variant"].lower()
        row = {**row}
        if any(name in variant for name in references):
            row["reference"] = True
        if any(name in variant for name in baselines):
            row["baseline"] = True
        rows.append(row)
    return {**doc, "rows": rows}


def shown_command(command: str) -> str:
    """The command without a ``--json FILE`` (a temporary file of the report's run)."""
    return " ".join(re.sub(r"\s--json(=|\s+)\S+", "", f" {command}").split())


def groups(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows by figure, in first-seen order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row["figure"], []).append(row)
    return out


def _points(rows: list[dict[str, Any]]) -> dict[float | None, list[dict[str, Any]]]:
    """The rows of one figure by ``x`` (None for rows without)."""
    points: dict[float | None, list[dict[str, Any]]] = {}
    for row in rows:
        points.setdefault(row.get("x"), []).append(row)
    return points


def baseline(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row marked ``baseline``, else ``plain torch``, else the first ddpkit competes with."""
    for row in rows:
        if row.get("baseline"):
            return row
    for row in rows:
        if row["variant"].lower() == "plain torch":
            return row
    return next((row for row in rows if competes(row)), None)


def gap(ours: dict[str, Any], theirs: dict[str, Any]) -> float:
    """How far ``ours`` is behind ``theirs`` (0.1: 10 % lower rate, or 10 % more time);
    negative when ours is better."""
    a, b = float(ours["value"]), float(theirs["value"])
    if a <= 0 or b <= 0:
        return 0.0
    return 1 - a / b if ours["higher_is_better"] else a / b - 1


@dataclass(frozen=True)
class Behind:
    """A baseline better than a ddpkit row: by ``gap``; ``worse`` of ``paired`` trials agree."""

    ours: str
    theirs: str
    gap: float
    x: float | None = None
    worse: int = 0  # trials (run side by side) in which ddpkit's value was the worse one
    paired: int = 0  # trials both rows have (0: the bench gave no per-trial values)

    @property
    def real(self) -> bool:
        """Beyond noise: more than NOISE, and (when trials are given) in most trials."""
        if self.gap <= NOISE:
            return False
        return self.paired < 3 or self.worse >= math.ceil(CONSISTENT * self.paired)

    def text(self) -> str:
        where = f" at x={_x(self.x)}" if self.x is not None else ""
        trials = f", worse in {self.worse} of {self.paired} trials" if self.paired >= 3 else ""
        return f"{self.ours} behind {self.theirs} by {_by(self.gap)}{where}{trials}"


def _worse_trials(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[int, int]:
    a, b = ours.get("trials") or [], theirs.get("trials") or []
    if len(a) != len(b):
        return 0, 0
    worse = sum((x < y) if ours["higher_is_better"] else (x > y) for x, y in zip(a, b, strict=True))
    return worse, len(a)


def verdicts(rows: list[dict[str, Any]], x: float | None = None) -> list[Behind]:
    """Every baseline better than a ddpkit row of ``rows`` (one figure, one ``x``)."""
    out = []
    for mine in (row for row in rows if ours(row)):
        for theirs in (row for row in rows if competes(row)):
            size = gap(mine, theirs)
            if size > 0:
                worse, paired = _worse_trials(mine, theirs)
                out.append(Behind(mine["variant"], theirs["variant"], size, x, worse, paired))
    return out


def why(notes: Mapping[str, Any], bench: str, figure: str) -> str:
    """The hand-written note for ``figure`` of ``bench`` (first key contained in the figure)."""
    for key, text in (notes.get(bench) or {}).items():
        if str(key).lower() in figure.lower():
            return " ".join(str(text).split())
    return ""


def _number(value: float) -> str:
    if value == 0 or 0.01 <= abs(value) < 1e7:
        digits = max(0, 3 - math.floor(math.log10(abs(value))) - 1) if value else 0
        return f"{value:,.{min(digits, 3)}f}"
    return f"{value:.3g}"


def _x(value: float) -> str:
    return f"{value:g}" if value < 1e4 else f"{value:.3g}"


def figure_lines(
    bench: str, figure: str, rows: list[dict[str, Any]], notes: Mapping[str, Any]
) -> list[str]:
    """The table and the verdict of one figure (grouped by ``x`` for a sweep)."""
    sweep = any("x" in row for row in rows)
    points = _points(rows)
    unit = rows[0]["unit"]
    better = "higher is better" if rows[0]["higher_is_better"] else "lower is better"
    lines = [f"**{figure}** ({unit}, {better})", ""]
    # Without a ddpkit row (phases of one run, say) there is nothing to compare: no ratios.
    compared = any(ours(row) for row in rows)
    head = ["x"] * sweep + ["variant", "value"] + ["ratio vs baseline"] * compared
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    behind: list[Behind] = []
    for x, point in points.items():
        base = baseline(point) if compared else None
        for row in point:
            if base is None or row is base:
                ratio = "baseline" if row is base else ""
            else:
                ratio = f"{float(row['value']) / float(base['value']):.3f}" if base["value"] else ""
            name = f"**{row['variant']}**" if ours(row) else row["variant"]
            name += " (reference)" if row.get("reference") else ""
            cells = [name, _number(float(row["value"]))] + [ratio] * compared
            where = [_x(x) if x is not None else ""] if sweep else []
            lines.append("| " + " | ".join(where + cells) + " |")
        behind += verdicts(point, x)
    lines.append("")
    lines += verdict_lines(bench, figure, rows, behind, notes)
    return lines


def verdict_lines(
    bench: str,
    figure: str,
    rows: list[dict[str, Any]],
    behind: list[Behind],
    notes: Mapping[str, Any],
) -> list[str]:
    if not any(ours(row) for row in rows):
        return []
    if not behind:
        return ["Verdict: ddpkit is at or ahead of every baseline.", ""]
    real = sorted((item for item in behind if item.real), key=lambda item: -item.gap)
    if not real:
        worst = max(behind, key=lambda item: item.gap)
        noise = f"<= {100 * NOISE:.0f}%" if worst.gap <= NOISE else "not in most trials"
        return [f"Verdict: level: {worst.text()}: within noise ({noise}).", ""]
    shown = "; ".join(item.text() for item in real[:4])
    reason = why(notes, bench, figure) or f"no note yet (add one to why.yaml under {bench!r})"
    return [f"Verdict: **BEHIND**: {shown}.", "", f"Why: {reason}", ""]


def _by(size: float) -> str:
    """A gap as a percentage, or as a factor once it is 100 % or more (times, not rates)."""
    return f"{100 * size:.1f}%" if size < 1 else f"{1 + size:.1f}x"


def machine_lines(machine: Mapping[str, str]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {key} | {value} |" for key, value in machine.items()), ""]


def render_markdown(
    outcomes: list[Outcome],
    machine: Mapping[str, str],
    command: str,
    notes: Mapping[str, Any],
    plots: Mapping[str, str] | None = None,
) -> str:
    """The whole REPORT.md."""
    plots = plots or {}
    lines = ["# ddpkit benchmark report", "", f"Reproduce: `{command}`", "", "## Machine", ""]
    lines += machine_lines(machine)
    lines += ["## Benches", "", "| bench | status | seconds | behind |", "|---|---|---|---|"]
    for outcome in outcomes:
        status = outcome.status if not outcome.reason else f"{outcome.status}: {outcome.reason}"
        marked = mark_references(outcome.doc, notes)
        count = sum(
            any(item.real for x, point in _points(rows).items() for item in verdicts(point, x))
            for rows in groups(marked["rows"]).values()
        )
        lines.append(f"| {outcome.name} | {status} | {outcome.seconds:.0f} | {count or ''} |")
    lines.append("")
    for outcome in outcomes:
        lines += bench_lines(outcome, notes, plots.get(outcome.name))
    if any(row.get("reference") for o in outcomes for row in mark_references(o.doc, notes)["rows"]):
        lines.append(
            "Rows marked (reference) show what the link or the hardware does alone "
            "(why.yaml's `_references`): shown, never counted as a baseline ddpkit is behind."
        )
    return "\n".join(lines).rstrip() + "\n"


def bench_lines(outcome: Outcome, notes: Mapping[str, Any], plot_file: str | None) -> list[str]:
    doc = outcome.doc
    source = f"`{outcome.name}.py`"
    if outcome.name.startswith("device_"):  # measured on a lent GPU machine, see report.py
        source = f"`ci/gpu-check.sh` on a lent GPU machine (results/device/{outcome.name[7:]}.json)"
    lines = [f"## {doc.get('title') or outcome.name}", "", f"{source}: {outcome.status}"]
    if outcome.status != "ok":
        lines[-1] += f": {outcome.reason}"
        lines.append("")
        if outcome.stderr_tail:
            lines += ["```text", outcome.stderr_tail.rstrip(), "```", ""]
        return lines
    took = f" ({outcome.seconds:.0f} s)" if outcome.seconds else ""
    lines[-1] += f"{took}. Command: `{shown_command(doc['command'])}`"
    lines.append("")
    doc = mark_references(doc, notes)
    if not doc["rows"]:
        lines += ["No figures from this run; its output ends:", ""]
        lines += ["```text", outcome.output_tail.rstrip() or "(nothing)", "```", ""]
    for figure, rows in groups(doc["rows"]).items():
        lines += figure_lines(doc["bench"], figure, rows, notes)
    for note in doc.get("notes") or []:
        lines.append(f"- {note}")
    if doc.get("notes"):
        lines.append("")
    if plot_file:
        lines += [f"![{doc['bench']}]({plot_file})", ""]
    return lines


def plot(doc: Mapping[str, Any], path: Path) -> Path:
    """One PNG for a bench: a bar chart per figure, a line plot per sweep (rows with ``x``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = groups(list(doc["rows"]))
    fig, axes = plt.subplots(len(figures), 1, figsize=(7.5, 2.4 * len(figures)), squeeze=False)
    for axis, (figure, rows) in zip(axes[:, 0], figures.items(), strict=True):
        if any("x" in row for row in rows):  # e.g. busbw over message sizes
            _sweep(axis, rows)
        else:
            _bars(axis, rows)
        better = "higher is better" if rows[0]["higher_is_better"] else "lower is better"
        axis.set_title(figure, fontsize=9)
        sweep = any("x" in row for row in rows)
        axis.set_xlabel("x" if sweep else f"{rows[0]['unit']} ({better})", fontsize=8)
        axis.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _bars(axis: Any, rows: list[dict[str, Any]]) -> None:
    names = [row["variant"] for row in rows]
    values = [float(row["value"]) for row in rows]
    colours = ["tab:orange" if ours(row) else "tab:blue" for row in rows]
    axis.barh(names[::-1], values[::-1], color=colours[::-1])
    for y, value in enumerate(values[::-1]):
        axis.text(value, y, f" {_number(value)}", va="center", fontsize=7)
    axis.margins(x=0.2)


def _sweep(axis: Any, rows: list[dict[str, Any]]) -> None:
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        lines.setdefault(row["variant"], []).append((float(row.get("x", 0)), float(row["value"])))
    references = {row["variant"] for row in rows if row.get("reference")}
    for name, points in lines.items():
        points.sort()
        style = "--" if name in references else "-"
        axis.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=name)
    for index, scale in ((0, axis.set_xscale), (1, axis.set_yscale)):
        values = [p[index] for points in lines.values() for p in points if p[index] > 0]
        if values and max(values) / min(values) > 100:  # decades apart: a log axis
            scale("log")
    axis.set_ylabel(rows[0]["unit"], fontsize=8)
    axis.legend(fontsize=7)
