"""MkDocs hooks for ddpkit's docs: the generated reference blocks and the benchmark report.

A page asks for a generated block with a marker alone on a line; the build replaces it:

    <!-- ddpkit:job-spec -->    every field of JobSpec (type, default, constraint, description),
    <!-- ddpkit:sweep-spec -->  of its sweep section (Sweep) and of ClusterProfile, from the
    <!-- ddpkit:profile-spec --> pydantic models in ddpkit.jobs.spec
    <!-- ddpkit:sbatch-keys --> the #SBATCH options a spec field owns (spec.RESERVED_SBATCH)
    <!-- ddpkit:env-vars -->    every DDPKIT_* variable, from env_var_rows()
    <!-- ddpkit:cli -->         `ddpkit --help` and every subcommand's help, from the argparse
                                parsers (ddpkit.cli.build_parser)

An unknown marker, a model field without a description, a default this module cannot describe,
or a DDPKIT_* name in src/ without a row of env_var_rows() raises, so `mkdocs build` fails.

The benchmark report (benchmarks/results/REPORT.md and its PNGs) is not copied into docs/: the
build adds those files to the site as benchmarks/report.md and benchmarks/*.png (on_files), so
docs/benchmarks/index.md links to it and `--strict` checks that link.

Importing this module needs ddpkit (installed) and pydantic, not mkdocs and not torch, so
tests/test_docs.py can check the coverage without building.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import os
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
REPORT_DIR = ROOT / "benchmarks" / "results"
REPORT_PAGE = "benchmarks/report.md"  # where the report appears in the site

_MARKER = re.compile(r"^<!-- ddpkit:([a-z-]+) -->$", re.MULTILINE)


# --- environment variables ---------------------------------------------------------------------


@dataclass(frozen=True)
class EnvVarRow:
    """One DDPKIT_* variable as the reference shows it."""

    name: str  # e.g. DDPKIT_PEER_TIMEOUT; DDPKIT_SWEEP_<NAME> stands for a family
    set_by: str  # "you" (a knob), "job script" (ddpkit's job scripts set it) or "sweep"
    default: str  # markdown; "" when there is none
    meaning: str  # markdown, one paragraph


def env_var_rows() -> list[EnvVarRow]:
    """Every DDPKIT_* variable a user meets, in the order the reference lists them: the one
    table ``ddpkit.contract.ENVIRONMENT``, rendered. A job-script variable's meaning ends with
    what a spec sets instead; ``{signals}`` / ``{job_signals}`` are the stop signals of
    ``ddpkit.cluster.stop`` (what ``DDPKIT_SIGNAL`` may name, what a spec's ``signal:`` takes).
    """
    contract = importlib.import_module("ddpkit.contract")
    stop = importlib.import_module("ddpkit.cluster.stop.signals")
    signals = {
        "{signals}": ", ".join(stop.ALLOWED_SIGNALS),
        "{job_signals}": " or ".join(stop.JOB_SIGNALS),
    }
    rows = []
    for variable in contract.ENVIRONMENT:
        meaning = variable.meaning
        for key, value in signals.items():
            meaning = meaning.replace(key, value)
        if variable.instead and variable.name in contract.RESERVED_ENV:
            meaning = f"{meaning} In a spec: {variable.instead}."
        rows.append(EnvVarRow(variable.name, variable.set_by, variable.default, meaning))
    return rows


def source_variables() -> set[str]:
    """Every DDPKIT_* name written in src/ddpkit (Python and templates)."""
    found: set[str] = set()
    for path in sorted(SRC.joinpath("ddpkit").rglob("*")):
        if path.suffix in (".py", ".j2"):
            found.update(re.findall(r"DDPKIT_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    return found


def uncovered_variables(rows: Iterable[EnvVarRow]) -> list[str]:
    """The names in src/ddpkit that no row covers (a family row covers its prefix)."""
    names = {row.name for row in rows}
    prefixes = tuple(name.removesuffix("<NAME>") for name in names if name.endswith("<NAME>"))
    return sorted(n for n in source_variables() if n not in names and not n.startswith(prefixes))


def render_env_vars() -> str:
    rows = env_var_rows()
    missing = uncovered_variables(rows)
    if missing:
        raise LookupError(
            f"src/ddpkit uses {', '.join(missing)} but env_var_rows() in "
            "docs/hooks/ddpkit_docs.py has no row for it: add one"
        )
    lines = ["| variable | set by | default | meaning |", "|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| `{row.name}` | {row.set_by} | {row.default or '-'} | {_cell(row.meaning)} |"
        )
    return "\n".join(lines)


# --- the job spec ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldRow:
    name: str  # e.g. nodes, or sweep.params
    type: str  # markdown
    default: str  # markdown; "required" when there is none
    constraint: str  # markdown; "" when none beyond the type
    description: str


# Defaults computed when a spec is loaded: the words for each (a new factory fails the build).
_FACTORY_TEXT: dict[tuple[str, str], str] = {
    ("JobSpec", "python"): "the Python running `ddpkit submit` (`sys.executable`)",
    ("JobSpec", "workdir"): "the directory you submit from",
}


def spec_models() -> dict[str, tuple[str, type[Any]]]:
    """marker -> (field prefix, model) for each table of the job-spec reference."""
    spec = importlib.import_module("ddpkit.jobs.spec")
    return {
        "job-spec": ("", spec.JobSpec),
        "sweep-spec": ("sweep.", spec.Sweep),
        "profile-spec": ("", spec.ClusterProfile),
        "container-spec": ("container.", spec.Container),
    }


def field_rows(model: type[Any], prefix: str = "") -> list[FieldRow]:
    """Every field of a pydantic model, in declaration order."""
    rows = []
    for name, info in model.model_fields.items():
        where = f"{model.__name__}.{name}"
        if not info.description:
            raise LookupError(f"{where} has no description: give its Field(description=...)")
        rows.append(
            FieldRow(
                prefix + name,
                _type_text(info.annotation),
                _default_text(model.__name__, name, info),
                _constraint_text(info.metadata),
                info.description,
            )
        )
    return rows


def render_fields(marker: str) -> str:
    prefix, model = spec_models()[marker]
    lines = ["| field | type | default | constraint | description |", "|---|---|---|---|---|"]
    for row in field_rows(model, prefix):
        lines.append(
            f"| `{row.name}` | {row.type} | {row.default} | {row.constraint or '-'} "
            f"| {describe(row.description)} |"
        )
    return "\n".join(lines)


def describe(description: str) -> str:
    """A field description as a table cell: the example after "e.g." shown as code."""
    head, sep, example = description.rpartition("e.g. ")
    if not sep:
        return _cell(description)
    return _cell(f"{head}e.g. `{example}`")


def render_sbatch_keys() -> str:
    spec = importlib.import_module("ddpkit.jobs.spec")
    lines = ["| `#SBATCH` option | instead |", "|---|---|"]
    lines += [f"| `{key}` | {_cell(why)} |" for key, why in spec.RESERVED_SBATCH.items()]
    return "\n".join(lines)


def _type_text(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_text(args[0])
    if origin in (typing.Union, types.UnionType):
        named = [_type_text(a) for a in args if a is not type(None)]
        text = ", ".join(named[:-1]) + (" or " if len(named) > 1 else "") + named[-1]
        return text + (" or null" if type(None) in args else "")
    if origin is typing.Literal:
        return " or ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {_type_text(args[0])}"
    if origin is dict:
        return f"mapping {_type_text(args[0])} → {_type_text(args[1])}"
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return "section (below)"
    simple = {str: "string", int: "integer", float: "number", bool: "true/false"}
    if annotation in simple:
        return simple[annotation]
    raise LookupError(f"no words for the type {annotation!r}: teach docs/hooks/ddpkit_docs.py")


def _default_text(model: str, name: str, info: Any) -> str:
    if info.default_factory is not None:
        factory = info.default_factory
        if factory in (dict, list):
            return f"`{factory()!r}`"
        text = _FACTORY_TEXT.get((model, name))
        if text is None:
            raise LookupError(f"{model}.{name}: say in _FACTORY_TEXT what its default is")
        return text
    if info.is_required():
        return "required"
    if info.default is None:
        return "null"
    if isinstance(info.default, enum.Enum):
        return f"`{info.default.value}`"
    return f"`{info.default}`"


def _constraint_text(metadata: Iterable[Any]) -> str:
    words = []
    for item in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(item, attr, None)
            if value is not None and type(item).__name__.lower() == attr:
                words.append(f"{sign} {value}")
    return ", ".join(words)


# --- the command line --------------------------------------------------------------------------


def cli_helps(width: int = 100) -> list[tuple[str, str]]:
    """(command, help text) for ``ddpkit`` and each subcommand, as ``--help`` prints them."""
    cli = importlib.import_module("ddpkit.cli")
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)  # argparse wraps to the terminal's width
    try:
        parser = cli.build_parser()
        helps = [("ddpkit", parser.format_help())]
        for action in parser._subparsers._group_actions if parser._subparsers else []:
            if isinstance(action, argparse._SubParsersAction):
                helps += [(f"ddpkit {n}", p.format_help()) for n, p in action.choices.items()]
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return helps


def render_cli() -> str:
    parts = []
    for command, text in cli_helps():
        parts.append(f"## `{command}`\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


# --- mkdocs hooks ------------------------------------------------------------------------------

GENERATORS: dict[str, Callable[[], str]] = {
    "job-spec": lambda: render_fields("job-spec"),
    "sweep-spec": lambda: render_fields("sweep-spec"),
    "profile-spec": lambda: render_fields("profile-spec"),
    "container-spec": lambda: render_fields("container-spec"),
    "sbatch-keys": render_sbatch_keys,
    "env-vars": render_env_vars,
    "cli": render_cli,
}


def expand_markers(markdown: str, where: str) -> str:
    def replace(match: re.Match[str]) -> str:
        generator = GENERATORS.get(match[1])
        if generator is None:
            known = ", ".join(GENERATORS)
            raise LookupError(f"{where}: unknown marker ddpkit:{match[1]} (known: {known})")
        return generator()

    return _MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    return expand_markers(markdown, page.file.src_uri)


def on_files(files: Any, config: Any, **_: Any) -> Any:
    """Add the benchmark report and its plots to the site (read from benchmarks/results/)."""
    from mkdocs.structure.files import File

    report = REPORT_DIR / "REPORT.md"
    files.append(File.generated(config, REPORT_PAGE, abs_src_path=str(report)))
    for png in sorted(REPORT_DIR.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/{png.name}", abs_src_path=str(png)))
    return files


# Docstrings use Sphinx roles (:func:`x`, :class:`~a.b.C`); show them as plain code (`C` for
# the `~` form, as Sphinx does).
_ROLE = re.compile(r":(?:func|class|mod|data|attr|meth|exc|obj):<code>(~[\w.]*\.)?")


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub("<code>", html)


def _cell(text: str) -> str:
    """Markdown text safe inside a table cell: one line, ``|`` escaped, and braces outside code
    spans written as entities (``{...}`` would read as an attribute list)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("{", "&#123;") for i, p in enumerate(parts))
