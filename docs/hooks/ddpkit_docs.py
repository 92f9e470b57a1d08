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
import ast
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
    defined_in: str  # where the name is defined in the code today (module.CONSTANT or file)


# What each variable of the job-script contract means. The names, and how a spec sets each,
# come from ddpkit.jobs.contract.CONTRACT; a contract variable missing here fails the build.
_CONTRACT_MEANING = {
    "DDPKIT_EXPECTED_WORLD_SIZE": (
        "The job's number of processes. Detection checks it: a process that finds itself a world "
        "of one in a job of several (Python started without `srun`) fails with a hint instead of "
        "training alone."
    ),
    "DDPKIT_HOST_TEMPLATE": (
        "How to name a node on the fast network, e.g. `{host}-ib`: the master address (and a "
        "`launch: torchrun` job's c10d endpoint) is the first node's name through it."
    ),
    "DDPKIT_JOB_LAUNCH": (
        "`srun` or `torchrun`: how the job starts its processes, so that detection can tell a "
        "torchrun started inside each of several srun tasks (duplicate ranks) from a right layout."
    ),
    "DDPKIT_SIGNAL": (
        "The stop signal `ddpkit.init()` latches and `preemption_guard()` watches. Accepted: "
        "{signals} (a spec's `signal:` takes USR1 or USR2)."
    ),
    "DDPKIT_MAX_REQUEUES": (
        "The requeue cap: `requeue_and_exit()` requeues only while `SLURM_RESTART_COUNT` is "
        "below it, else every rank exits 75."
    ),
    "DDPKIT_LATCH_DIR": (
        "A fresh folder in `log_dir` where each process marks that it has latched the stop "
        "signal; the batch shell passes a held signal on once every process has. Every node must "
        "see the same folder."
    ),
    "DDPKIT_SWEEP_TASK": "A sweep run's array index (0, 1, ...).",
    "DDPKIT_SWEEP_RUN": "A sweep run's name, e.g. `lr=0.1,seed=2`: use it to name its folders.",
}


def env_var_rows() -> list[EnvVarRow]:
    """Every DDPKIT_* variable a user meets, in the order the reference lists them.

    Today the names live where they are used, and this function collects them:

    - the job-script contract: ``ddpkit.jobs.contract.CONTRACT`` (names and how a spec sets
      each), with the meanings in ``_CONTRACT_MEANING`` above;
    - the sweep's per-parameter family: ``ddpkit.jobs.sweep.SWEEP_VAR_PREFIX``;
    - knobs: ``ddpkit.worker.rendezvous.store.CONNECT_TIMEOUT_VAR``,
      ``ddpkit.worker.process_group.COLLECTIVE_TIMEOUT_VAR`` / ``DEFAULT_CONNECT_TIMEOUT_S``
      (read from the source files: those modules import torch),
      ``ddpkit.worker.watchdog.policy.PEER_TIMEOUT_VAR`` / ``DEFAULT_PEER_TIMEOUT_S``,
      ``ddpkit.worker.progress.PROGRESS_VAR``, ``ddpkit.worker.rankzero.LOG_ALL_RANKS_VAR``,
      ``ddpkit.worker.requeue.DEFAULT_SIGNAL`` / ``DEFAULT_MAX_REQUEUES`` / ``ALLOWED_SIGNALS``,
      ``ddpkit.launch.deathsig.TOKEN_VAR``, and ``DDPKIT_HOME``, which has no constant (a
      literal in ``ddpkit/jobs/records.py`` and ``ddpkit/jobs/load.py``).

    Once one module owns every name, point this function at its table instead.
    """
    contract = importlib.import_module("ddpkit.jobs.contract")
    sweep = importlib.import_module("ddpkit.jobs.sweep")
    requeue = importlib.import_module("ddpkit.worker.requeue")
    policy = importlib.import_module("ddpkit.worker.watchdog.policy")
    progress = importlib.import_module("ddpkit.worker.progress")
    rankzero = importlib.import_module("ddpkit.worker.rankzero")
    group = _literals("ddpkit/worker/rendezvous/store.py", "CONNECT_TIMEOUT_VAR") | _literals(
        "ddpkit/worker/process_group.py",
        "COLLECTIVE_TIMEOUT_VAR",
        "DEFAULT_CONNECT_TIMEOUT_S",
    )
    home = _literal_in("DDPKIT_HOME", "ddpkit/jobs/records.py")
    deathsig = importlib.import_module("ddpkit.launch.deathsig")

    rows = [
        EnvVarRow(
            group["CONNECT_TIMEOUT_VAR"],
            "you",
            f"{group['DEFAULT_CONNECT_TIMEOUT_S']:g} s",
            "Seconds a rank other than 0 waits for the master to accept connections before "
            "`ddpkit.init()` fails naming the address, port and launcher. "
            "`init(connect_timeout_s=)` wins over it.",
            "ddpkit.worker.rendezvous.store.CONNECT_TIMEOUT_VAR",
        ),
        EnvVarRow(
            group["COLLECTIVE_TIMEOUT_VAR"],
            "you",
            "torch's (10-30 min by backend)",
            "The collective timeout in seconds: it bounds a rank that hangs while alive. Keep it "
            "above your program's longest wait (ranks at a barrier while rank 0 prepares data). "
            "`init(timeout_s=)` wins over it.",
            "ddpkit.worker.process_group.COLLECTIVE_TIMEOUT_VAR",
        ),
        EnvVarRow(
            policy.PEER_TIMEOUT_VAR,
            "you",
            f"{policy.DEFAULT_PEER_TIMEOUT_S:g} s",
            "The watchdog's bound in seconds: when a peer has exited, died or frozen and this "
            "rank stays blocked that long, it ends with a line naming the peer. `0` or `off` "
            "turns the watchdog off; `init(peer_timeout_s=)` wins over it.",
            "ddpkit.worker.watchdog.policy.PEER_TIMEOUT_VAR",
        ),
        EnvVarRow(
            progress.PROGRESS_VAR,
            "you",
            "a bar only on a terminal",
            "`0` silences `ddpkit.progress`; `1` draws it on the main rank even into a file (a "
            "line every 10 s). Also true/false, yes/no, on/off.",
            "ddpkit.worker.progress.PROGRESS_VAR",
        ),
        EnvVarRow(
            rankzero.LOG_ALL_RANKS_VAR,
            "you",
            "main rank only",
            "`1`: `ddpkit.get_logger()` logs on every rank at DEBUG, each line prefixed with its "
            "rank.",
            "ddpkit.worker.rankzero.LOG_ALL_RANKS_VAR",
        ),
        EnvVarRow(
            home,
            "you",
            "`~/.cache/ddpkit`",
            "Where `ddpkit submit` keeps its job records (`$DDPKIT_HOME/jobs`), and the third "
            "place a profile name is looked up (`$DDPKIT_HOME/profiles`; unset: "
            "`${XDG_CONFIG_HOME:-~/.config}/ddpkit/profiles`).",
            "literal in ddpkit/jobs/records.py and ddpkit/jobs/load.py",
        ),
        EnvVarRow(
            deathsig.TOKEN_VAR,
            "`ddpkit run`",
            "",
            "A fresh value per launch in the environment of its workers, and so of every process "
            "they start. When the launcher dies without having ended normally (`kill -9`, the "
            "OOM killer), its sweeper kills every process that carries it (Linux). Not yours to "
            "set.",
            "ddpkit.launch.deathsig.TOKEN_VAR",
        ),
    ]
    defaults = {
        contract.SIGNAL_VAR: f"`{requeue.DEFAULT_SIGNAL}`",
        contract.MAX_REQUEUES_VAR: f"{requeue.DEFAULT_MAX_REQUEUES}",
    }
    for variable in contract.CONTRACT:
        meaning = _CONTRACT_MEANING.get(variable.name)
        if meaning is None:
            raise LookupError(
                f"{variable.name} (ddpkit.jobs.contract.CONTRACT) has no meaning in "
                f"docs/hooks/ddpkit_docs.py's _CONTRACT_MEANING: describe it there"
            )
        meaning = meaning.replace("{signals}", ", ".join(requeue.ALLOWED_SIGNALS))
        is_sweep = variable.name.startswith(sweep.SWEEP_VAR_PREFIX)
        rows.append(
            EnvVarRow(
                variable.name,
                "sweep" if is_sweep else "job script",
                defaults.get(variable.name, ""),
                f"{meaning} In a spec: {variable.instead}.",
                "ddpkit.jobs.contract.CONTRACT",
            )
        )
    rows.append(
        EnvVarRow(
            sweep.SWEEP_VAR_PREFIX + "<NAME>",
            "sweep",
            "",
            "Each sweep parameter's value for this run, e.g. `DDPKIT_SWEEP_LR=0.1` for `lr`. "
            "A spec's `env` may not set a name with this prefix.",
            "ddpkit.jobs.sweep.SWEEP_VAR_PREFIX",
        )
    )
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


def _literals(relative: str, *names: str) -> dict[str, Any]:
    """Module-level constants of ``src/<relative>``, read from its source without importing it."""
    tree = ast.parse(SRC.joinpath(relative).read_text(encoding="utf-8"))
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id in names and node.value:
                    found[target.id] = ast.literal_eval(node.value)
    missing = [name for name in names if name not in found]
    if missing:
        raise LookupError(f"src/{relative} no longer defines {', '.join(missing)}")
    return found


def _literal_in(name: str, relative: str) -> str:
    if f'"{name}"' not in SRC.joinpath(relative).read_text(encoding="utf-8"):
        raise LookupError(f"src/{relative} no longer reads {name}")
    return name


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
