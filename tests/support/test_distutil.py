"""The multi-process helper itself: its workers see the test's environment of the moment."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

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


def _fails_like_gloo_against(rank: int, world_size: int, port: int, held: int) -> None:
    # gloo names the peer's port with its two bytes swapped (network byte order)
    raise RuntimeError(
        "Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer "
        f"[127.0.0.1]:{socket.htons(held)}. This is typically caused by a remote worker crashing"
    )


def test_a_full_mesh_closed_by_a_peer_names_who_holds_that_port() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        with pytest.raises(AssertionError) as failed:
            run_workers(_fails_like_gloo_against, 1, held)
    text = str(failed.value)
    assert f"sockets on port {held} (gloo printed {socket.htons(held)}, byte-swapped) then:" in text
    assert f"127.0.0.1:{held}" in text and f"{os.getpid()}: " in text  # this process holds it


def _one_fails_the_other_waits(rank: int, world_size: int, port: int, other: str, at: str) -> None:
    ready = Path(at) / "rank0-ready"
    if rank == 1:  # once rank 0 stands where the test looks for it
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("rank 1 gives up")
    ready.touch()
    if other == "raises":
        time.sleep(0.5)
        raise RuntimeError("rank 0 saw it first")
    _wait_here_for_good()


def _wait_here_for_good() -> None:
    time.sleep(120)


@pytest.mark.parametrize("other", ["waits", "raises"])
def test_a_failed_rank_comes_with_what_the_others_did_then(other: str, tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as failed:
        run_workers(_one_fails_the_other_waits, 2, other, str(tmp_path))
    text = str(failed.value)
    assert "rank 1 raised:" in text and "rank 1 gives up" in text
    assert "the other ranks then:" in text
    if other == "waits":  # where rank 0 stood: its stack, though it slept in C
        assert "_one_fails_the_other_waits" in text.split("rank 0 running, its threads:")[1]
    else:
        assert "rank 0 raised:" in text and "rank 0 saw it first" in text
