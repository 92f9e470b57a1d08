"""Job-derived ports (deterministic, wide, no aliasing) and the free-port helper."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit
from ddpkit.cluster.ports import PORT_RANGE_END, PORT_RANGE_START, free_port, port_for_job
from ddpkit.errors import ConfigError

# Where the ddpkit under test lives (src/ checkout or site-packages), for child interpreters.
SRC = Path(ddpkit.__file__).resolve().parents[1]
SPAN = PORT_RANGE_END - PORT_RANGE_START + 1


def test_range_is_wide_and_below_the_linux_ephemeral_range() -> None:
    assert PORT_RANGE_START >= 1024
    assert PORT_RANGE_END < 32768
    assert SPAN > 20000


@pytest.mark.parametrize(
    ("job_id", "step_id", "port"),
    # Pinned: a launcher and its workers may run different ddpkit versions; the mapping must
    # not drift silently.
    [("1234", None, 19009), ("1234", "0", 19782), ("1234", "1", 26869), ("5000", None, 16016)],
)
def test_port_for_job_is_pinned(job_id: str, step_id: str | None, port: int) -> None:
    assert port_for_job(job_id, step_id) == port


@pytest.mark.parametrize("job_id", ["1", "1234", "987654321", "12345_7", "abc"])
def test_port_for_job_is_in_range_and_repeatable(job_id: str) -> None:
    port = port_for_job(job_id)
    assert PORT_RANGE_START <= port <= PORT_RANGE_END
    assert port_for_job(job_id) == port
    assert port_for_job(f" {job_id} ") == port


def test_port_for_job_is_the_same_in_other_processes() -> None:
    # Python's hash() is salted per process; two interpreters with different seeds must agree.
    code = "from ddpkit.cluster.ports import port_for_job; print(port_for_job('777', '3'))"
    ports = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        ports.add(int(out.stdout))
    assert ports == {port_for_job("777", "3")}


@pytest.mark.parametrize(
    "ids",
    [("1234", "11234", "21234"), ("5000", "15000"), ("42", "1042", "100042", "9999042")],
)
def test_ids_sharing_last_digits_do_not_alias(ids: tuple[str, ...]) -> None:
    ports = [port_for_job(job_id) for job_id in ids]
    assert len(set(ports)) == len(ports), dict(zip(ids, ports, strict=True))


@pytest.mark.parametrize("suffix", [1234, 5000, 42])
def test_ids_with_the_same_last_four_digits_spread_out(suffix: int) -> None:
    # 100 ids that a "last four digits" or "% 1000" scheme would map to ONE port.
    ports = {port_for_job(str(k * 10000 + suffix)) for k in range(100)}
    assert len(ports) >= 97  # birthday expectation for 100 draws from ~22768 ports: ~0.2 clashes


def test_collisions_over_consecutive_ids_follow_the_birthday_bound() -> None:
    n = 2000
    ports = [port_for_job(str(job_id)) for job_id in range(4_000_000, 4_000_000 + n)]
    clashes = n - len(set(ports))
    expected = n - SPAN * (1 - math.exp(-n / SPAN))  # ~85 for a uniform hash
    assert clashes < 1.5 * expected, (clashes, expected)
    # Every port stays in range, and the values are not bunched into one corner of it.
    assert min(ports) >= PORT_RANGE_START
    assert max(ports) <= PORT_RANGE_END
    quarters = [sum(1 for p in ports if (p - PORT_RANGE_START) * 4 // SPAN == q) for q in range(4)]
    assert all(400 <= count <= 600 for count in quarters), quarters


def test_step_id_changes_the_port() -> None:
    ports = {port_for_job("4242", str(step)) for step in range(20)} | {port_for_job("4242")}
    assert len(ports) == 21


def test_job_and_step_ids_do_not_run_together() -> None:
    assert port_for_job("12", "34") != port_for_job("123", "4")
    assert port_for_job("1234") != port_for_job("12", "34")


@pytest.mark.parametrize("job_id", ["", "   "])
def test_empty_job_id_is_rejected(job_id: str) -> None:
    with pytest.raises(ConfigError, match=r"job_id=.* is empty"):
        port_for_job(job_id)


def test_free_port_can_be_bound() -> None:
    port = free_port()
    assert 1 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_returns_a_port_not_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert all(free_port() != taken for _ in range(20))
