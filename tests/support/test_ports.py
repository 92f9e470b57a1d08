"""free_port: ports outside the kernel's ephemeral range, each handed out once while claimed."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.support import ports
from tests.support.ports import free_port


def _ephemeral() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_free_ports_are_outside_the_kernels_range_and_never_handed_out_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ports, "_CLAIMS", tmp_path / "claims")
    monkeypatch.setattr(ports.random, "randrange", lambda span: 0)  # every pick starts low
    low, high = _ephemeral()
    picked = [free_port() for _ in range(3)]
    assert picked == [high + 1, high + 2, high + 3]  # the claimed ones are skipped
    assert not low <= min(picked) <= high
    with socket.create_server(("127.0.0.1", high + 4)):  # a listener's port is skipped too
        assert free_port() == high + 5


def test_a_claim_lapses_after_its_time_and_a_bad_line_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = tmp_path / "claims"
    monkeypatch.setattr(ports, "_CLAIMS", claims)
    monkeypatch.setattr(ports.random, "randrange", lambda span: 0)
    first = _ephemeral()[1] + 1
    claims.write_text(f"{first}@{time.time() - ports._CLAIM_S - 1:.0f}\nnot-a-claim\n")
    assert free_port() == first
    (line,) = claims.read_text().splitlines()  # the lapsed claim and the bad line gone
    port, when = line.split("@")
    assert int(port) == first and time.time() - float(when) < 60
    assert free_port() == first + 1
