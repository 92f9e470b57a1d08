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


def test_the_resolver_tests_name_the_tool_they_lack(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller of :func:`needs.missing` (the private resolver files): once a local list of the
    same name hid the helper, and a machine without unshare got a TypeError, not the reason."""
    from tests.support import resolver

    monkeypatch.setenv("CI", "")
    monkeypatch.setattr(resolver.shutil, "which", lambda tool: None if tool == "unshare" else tool)
    with pytest.raises(pytest.skip.Exception, match=r"^needs unshare(, root)?: a resolv.conf"):
        resolver.private_files_or_skip()
