"""free_port: ports outside the kernel's ephemeral range, each handed out once while claimed."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import ports
from tests.support.ports import free_port


def _ephemeral() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def _alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: frozenset[int]) -> Path:
    """free_port with a claims file of its own, every scan starting at the range's first port,
    and ``taken`` the ports that do not bind (real listeners there would race the suite's own
    free_port calls, which share the range); the claims file."""
    monkeypatch.setattr(ports, "_CLAIMS", tmp_path / "claims")
    monkeypatch.setattr(ports, "random", SimpleNamespace(randrange=lambda span: 0))
    monkeypatch.setattr(ports, "_binds", lambda port: port not in taken)
    return tmp_path / "claims"


def test_free_ports_skip_claimed_and_taken_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    high = _ephemeral()[1]
    _alone(tmp_path, monkeypatch, frozenset({high + 4}))
    assert [free_port() for _ in range(4)] == [high + 1, high + 2, high + 3, high + 5]


def test_a_claim_lapses_after_its_time_and_a_bad_line_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _ephemeral()[1] + 1
    claims = _alone(tmp_path, monkeypatch, frozenset())
    claims.write_text(f"{first}@{time.time() - ports._CLAIM_S - 1:.0f}\nnot-a-claim\n")
    assert free_port() == first
    (line,) = claims.read_text().splitlines()  # the lapsed claim and the bad line gone
    port, when = line.split("@")
    assert int(port) == first and time.time() - float(when) < 60
    assert free_port() == first + 1


def test_a_real_pick_is_above_the_kernels_range_and_a_held_port_does_not_bind() -> None:
    assert _ephemeral()[1] < free_port() <= 65535
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert not ports._binds(server.getsockname()[1])
