"""The doctor and its communication step depend on ``tools/doctor_checks.py`` (checks, options
and report), not on each other: no import of ``tools/doctor.py`` from ``tools/commtest.py``,
not even one hidden under ``TYPE_CHECKING`` (a cycle that type checking alone still needs)."""

from __future__ import annotations

import ast
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "src" / "ddpkit" / "tools"


def imported(path: Path) -> set[str]:
    """Every ddpkit module ``path`` names in an import, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("ddpkit")}


def test_commtest_does_not_import_the_doctor() -> None:
    assert "ddpkit.tools.doctor" not in imported(TOOLS / "commtest.py")
    assert "ddpkit.tools.doctor_checks" in imported(TOOLS / "commtest.py")


def test_doctor_checks_imports_neither() -> None:
    names = imported(TOOLS / "doctor_checks.py")
    assert not names & {"ddpkit.tools.doctor", "ddpkit.tools.commtest"}, names
