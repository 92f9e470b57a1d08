"""The multi-process helper itself: its workers see the test's environment of the moment."""

from __future__ import annotations

import os
import sys

import pytest

from tests.support.distutil import run_workers


def _what_the_worker_sees(rank: int, world_size: int, port: int) -> tuple[str | None, bool]:
    # ddpkit holds state (the active group, signal handlers): the server must not import it.
    return os.environ.get("DDPKIT_TEST_SEEN"), "ddpkit" in sys.modules


def test_each_worker_gets_the_environment_of_the_moment_not_the_fork_servers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DDPKIT_TEST_SEEN", "first")
    assert run_workers(_what_the_worker_sees, 2)[0][0] == "first"  # the server starts here
    monkeypatch.setenv("DDPKIT_TEST_SEEN", "second\nline")
    assert run_workers(_what_the_worker_sees, 2) == [("second\nline", False)] * 2
    monkeypatch.delenv("DDPKIT_TEST_SEEN")
    assert run_workers(_what_the_worker_sees, 1) == [(None, False)]
