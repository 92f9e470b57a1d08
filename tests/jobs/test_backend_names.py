"""Each backend owns its behaviour: no module outside ``jobs/backends/`` branches on a backend's
name (``via == "submitit"``, ``record.via in (...)``, ``"torchx" if ... else "sbatch"``, a
``case "sbatch":``). A new backend is then one module and one registry line, not a hunt for
``if via == ...`` across the jobs API, the log readers and the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from ddpkit.jobs.records import Via

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ddpkit"
BACKENDS_DIR = PACKAGE / "jobs" / "backends"
NAMES = frozenset(get_args(Via))


def _names_in(node: ast.AST) -> list[str]:
    """Backend names spelled as string constants in ``node`` (tuples and sets included)."""
    return [
        sub.value
        for sub in ast.walk(node)
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value in NAMES
    ]


def branches_on_names(tree: ast.AST) -> list[str]:
    """``line: code`` of each comparison, conditional expression or ``case`` on a backend name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            hit = any(_names_in(part) for part in parts)
        elif isinstance(node, ast.IfExp):
            hit = bool(_names_in(node.body) or _names_in(node.orelse))
        elif isinstance(node, ast.match_case):
            hit = bool(_names_in(node.pattern))
        else:
            continue
        if hit:
            found.append(f"{getattr(node, 'lineno', '?')}: {ast.unparse(node)}"[:120])
    return found


def name_branches() -> dict[str, list[str]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if BACKENDS_DIR in path.parents:
            continue
        hits = branches_on_names(ast.parse(path.read_text(encoding="utf-8")))
        if hits:
            found[str(path.relative_to(PACKAGE))] = hits
    return found


def test_no_module_outside_the_backends_branches_on_a_backend_name() -> None:
    assert name_branches() == {}


def test_the_scan_sees_each_kind_of_branch() -> None:
    code = (
        'if record.via == "submitit": pass\n'
        'if via in ("torchx", "x"): pass\n'
        'b = "torchx" if handle else "sbatch"\n'
        'match via:\n    case "sbatch": pass\n'
        'launch = "srun"; d = {"via": "sbatch"}; f(via="sbatch")\n'  # naming is not branching
    )
    assert [hit.split(":")[0] for hit in branches_on_names(ast.parse(code))] == [
        "1",
        "2",
        "3",
        "?",
    ]
