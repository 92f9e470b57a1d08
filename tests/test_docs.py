"""The generated references cover what they document, and the README's links resolve.

`mkdocs build --strict` (ci/test.sh) catches broken links inside docs/; these tests hold the
generators in docs/hooks/ddpkit_docs.py to their promise (every spec field, every DDPKIT_*
variable, every subcommand) and check the README, which the docs build does not read.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[1]


def _hooks() -> ModuleType:
    path = ROOT / "docs" / "hooks" / "ddpkit_docs.py"
    spec = importlib.util.spec_from_file_location("ddpkit_docs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("ddpkit_docs", module)
    spec.loader.exec_module(module)
    return module


docs = _hooks()


@pytest.mark.parametrize("marker", ["job-spec", "sweep-spec", "profile-spec", "container-spec"])
def test_spec_reference_lists_every_field_with_its_description(marker: str) -> None:
    prefix, model = docs.spec_models()[marker]
    table = docs.expand_markers(f"<!-- ddpkit:{marker} -->", "test")
    for name, info in model.model_fields.items():
        row = next((line for line in table.splitlines() if f"| `{prefix}{name}` |" in line), None)
        assert row is not None, f"{model.__name__}.{name} is missing from the reference"
        assert info.description and docs.describe(info.description) in row


def test_a_field_without_description_fails_the_reference() -> None:
    class Bare(BaseModel):
        documented: int = Field(1, description="has one")
        undocumented: int = 2

    with pytest.raises(LookupError, match=r"Bare\.undocumented has no description"):
        docs.field_rows(Bare)


def test_environment_reference_covers_every_variable_in_src() -> None:
    rows = docs.env_var_rows()
    assert docs.uncovered_variables(rows) == []
    table = docs.expand_markers("<!-- ddpkit:env-vars -->", "test")
    for row in rows:
        assert row.name.startswith("DDPKIT_") and row.meaning and row.set_by
        assert f"| `{row.name}` |" in table
    assert len({row.name for row in rows}) == len(rows), "a variable has two rows"


def test_a_variable_without_a_row_is_reported() -> None:
    rows = [row for row in docs.env_var_rows() if row.name != "DDPKIT_PEER_TIMEOUT"]
    assert docs.uncovered_variables(rows) == ["DDPKIT_PEER_TIMEOUT"]


def test_cli_reference_has_every_subcommand() -> None:
    text = docs.expand_markers("<!-- ddpkit:cli -->", "test")
    for command in ("run", "plan", "submit", "status", "logs", "cancel", "env", "doctor"):
        assert f"## `ddpkit {command}`" in text
        assert f"usage: ddpkit {command}" in text


def test_unknown_marker_fails() -> None:
    with pytest.raises(LookupError, match="unknown marker ddpkit:nope"):
        docs.expand_markers("<!-- ddpkit:nope -->", "page.md")


def test_readme_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links into docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == []


def test_readme_first_bash_blocks_are_the_two_commands() -> None:
    """ci/contract.sh runs the first `ddpkit run` line of a bash block; .ci/run the second."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```bash\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert blocks[0].strip() == (
        "pip install -c ci/constraints.txt -e . && ddpkit run --nproc-per-node 2 examples/train.py"
    )
    assert blocks[1].strip() == "bash ci/test.sh"
