"""The helper for what a test needs: a missing piece fails under CI=true, is skipped elsewhere."""

from __future__ import annotations

import pytest

from tests.support import needs


@pytest.mark.parametrize(
    ("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)]
)
def test_a_missing_module_fails_on_ci_and_is_skipped_elsewhere(
    monkeypatch: pytest.MonkeyPatch, ci: str, outcome: type[BaseException]
) -> None:
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match=r"no_such_module_ddpkit cannot be imported .*pip install"):
        needs.module("no_such_module_ddpkit")


def test_a_present_module_is_returned() -> None:
    assert needs.module("json").dumps([1]) == "[1]"
