"""Ports for the tests' rendezvous stores: claimed, and outside the kernel's ephemeral range.

Torch-free, so that a test that only starts processes needs no torch import for a port.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from pathlib import Path

__all__ = ["free_port"]

# Claims of the ports free_port handed out (one "port@time" a line), shared by every pytest
# process of this user on the machine, under an flock; a claim lapses after _CLAIM_S.
_CLAIMS = Path(tempfile.gettempdir()) / f"ddpkit-test-ports-{os.getuid()}"
_CLAIM_S = 900.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that binds now and that no other test is handed for 15 minutes.

    Not a port the kernel picks (bind to port 0): those come from its ephemeral range, from
    which it also picks every other port-0 bind on the machine (gloo's listeners, stores on
    port 0, another test's pick), and one of those took a test's port between the pick and
    rank 0's bind, seconds later on the loaded CI machine (EADDRINUSE in CI). So the port comes
    from above the ephemeral range (61000-65535 on a default Linux; the kernel hands out nothing
    there), and each is claimed in a file shared by every pytest process here (both CI
    sessions, all xdist workers), so that two tests never get the same one.
    """
    low, high = _ports_above_ephemeral()
    with open(_CLAIMS, "a+", encoding="ascii") as claims:
        fcntl.flock(claims, fcntl.LOCK_EX)  # released when the file closes
        claims.seek(0)
        now = time.time()
        live = {port: when for port, when in _read_claims(claims.read()) if now - when < _CLAIM_S}
        span = high - low + 1
        start = random.randrange(span)
        for offset in range(span):
            port = low + (start + offset) % span
            if port not in live and _binds(port):
                live[port] = now
                claims.seek(0)
                claims.truncate()
                claims.write("".join(f"{held}@{when:.0f}\n" for held, when in live.items()))
                return port
    raise RuntimeError(f"free_port: all of ports {low}-{high} are taken or claimed in {_CLAIMS}")


def _ports_above_ephemeral() -> tuple[int, int]:
    """The ports above the kernel's ephemeral range (``ip_local_port_range``)."""
    try:
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        high = 60999  # Linux's default
    if 65535 - high < 512:
        raise RuntimeError(f"free_port: the ephemeral range ends at {high}: too few ports above it")
    return high + 1, 65535


def _read_claims(text: str) -> list[tuple[int, float]]:
    claims = []
    for line in text.split():
        port, _, when = line.partition("@")
        with contextlib.suppress(ValueError):
            claims.append((int(port), float(when)))
    return claims


def _binds(port: int) -> bool:
    """Whether a listener could bind the port now (no SO_REUSEADDR: nor in TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
