"""Golden files for generated artifacts: compare with a readable diff, regenerate on request.

``DDPKIT_REGEN_GOLDEN=1 python -m pytest tests/...`` rewrites the files instead of comparing.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
REGEN_VAR = "DDPKIT_REGEN_GOLDEN"


def check_golden(path: Path, text: str, *, what: str) -> None:
    """``text`` equals the file at ``path``, or a unified diff fails the test."""
    if os.environ.get(REGEN_VAR) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    if not path.exists():
        pytest.fail(f"golden file {path} is missing; create it with {REGEN_VAR}=1")
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = difflib.unified_diff(
            expected.splitlines(True), text.splitlines(True), str(path), what
        )
        pytest.fail(f"{what} differs from {path} (if intended: {REGEN_VAR}=1):\n" + "".join(diff))
