"""Naming this host's address as torch's store client asks for it, and what to say when the
resolver is slow (torch-free: no store here; the real resolver is met in
tests/worker/rendezvous/test_slow_lookup.py and tests/tools/test_tools_doctor.py)."""

from __future__ import annotations

import math
import socket
import threading
import time

import pytest

from ddpkit.cluster.rendezvous import lookup


@pytest.mark.parametrize(
    ("local", "named"),
    [("127.0.0.1", "::ffff:127.0.0.1"), ("10.0.0.5", "::ffff:10.0.0.5"), ("::1", "::1"),
     ("fe80::1%eth0", "fe80::1"), ("[2001:db8::7]", "2001:db8::7"), ("not-an-ip", "not-an-ip")],
)  # fmt: skip
def test_torch_names_the_mapped_form_of_an_ipv4_address(local: str, named: str) -> None:
    assert lookup.torch_socket_address(local) == named


def test_name_lookups_are_made_at_once_and_waited_for_within_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The resolver itself cannot be made slow on demand: getnameinfo is replaced by one that
    answers, refuses or hangs (a resolver whose nameserver never answers)."""
    inside, most, lock = [0], [0], threading.Lock()
    release = threading.Event()

    def answers(where: tuple[str, int], flags: int) -> tuple[str, str]:
        assert where == ("::ffff:10.0.0.5", 0) and flags == socket.NI_NAMEREQD
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] == 16:  # the last asked while none had an answer: made at once
                release.set()
        release.wait(5)
        with lock:
            inside[0] -= 1
        return "n1", "0"

    monkeypatch.setattr(socket, "getnameinfo", answers)
    took = lookup.name_lookups_s("::ffff:10.0.0.5", 16, 3.0)  # one at a time: none answered
    assert took < 3.0 and most[0] == 16

    def refuses(where: tuple[str, int], flags: int) -> tuple[str, str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getnameinfo", refuses)
    assert lookup.name_lookups_s("::ffff:10.0.0.5", 4, 3.0) < 1.0  # a refusal is an answer

    hang = threading.Event()
    monkeypatch.setattr(socket, "getnameinfo", lambda where, flags: hang.wait(10))
    start = time.monotonic()
    assert lookup.name_lookups_s("::ffff:10.0.0.5", 4, 0.3) == math.inf
    assert time.monotonic() - start < 2.0  # the bound, not the resolver's timeout
    hang.set()


def test_the_hint_names_the_mapped_address_only_when_its_lookup_is_slow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The resolver's answer on demand: getnameinfo replaced by one that answers at once, or
    not within the bound; a lookup timed at 0.7 s, for the figure the hint prints."""
    asked: list[tuple[str, int]] = []

    def answers(where: tuple[str, int], flags: int) -> tuple[str, str]:
        asked.append(where)
        return "vm", "0"

    monkeypatch.setattr(socket, "getnameinfo", answers)
    assert lookup.slow_lookup_hint("127.0.0.1") is None
    assert asked == [("::ffff:127.0.0.1", 0)]  # the form torch's client names
    silent = threading.Event()
    monkeypatch.setattr(socket, "getnameinfo", lambda where, flags: silent.wait(10))
    hint = lookup.slow_lookup_hint("127.0.0.1", 0.2)
    silent.set()
    assert hint is not None and "took over 0.2 s to name ::ffff:127.0.0.1" in hint
    assert "add a line '::ffff:127.0.0.1 " in hint and "to /etc/hosts on every node" in hint
    monkeypatch.setattr(lookup, "name_lookups_s", lambda address, count, bound_s: 0.7)
    hint = lookup.slow_lookup_hint("127.0.0.1")
    assert hint is not None and "took 0.7 s to name ::ffff:127.0.0.1" in hint
    assert lookup.slow_lookup_hint("not an address") is None  # no route: nothing to say
    hang = threading.Event()
    monkeypatch.setattr(lookup, "route_to", lambda address: hang.wait(10) and None)
    start = time.monotonic()
    assert lookup.slow_lookup_hint("n1", 0.2) is None  # a name DNS cannot resolve in time
    assert time.monotonic() - start < 2.0
    hang.set()
