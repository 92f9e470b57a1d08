"""Naming this host's address as torch's store client asks for it, and what to say when the
resolver is slow (torch-free: no store here; the real resolver is met in
tests/worker/rendezvous/test_slow_lookup.py and tests/tools/test_tools_doctor.py)."""

from __future__ import annotations

import math
import socket
import threading

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
    # all 16 asked at once: each answers only once the 16th asked (one at a time, none would)
    took = lookup.name_lookups_s("::ffff:10.0.0.5", 16, 30.0)
    assert took < math.inf and most[0] == 16

    def refuses(where: tuple[str, int], flags: int) -> tuple[str, str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getnameinfo", refuses)
    assert lookup.name_lookups_s("::ffff:10.0.0.5", 4, 30.0) < math.inf  # a refusal answers

    hang, waiting = threading.Event(), [0]

    def hangs(where: tuple[str, int], flags: int) -> None:
        with lock:
            waiting[0] += 1
        hang.wait(60)
        with lock:
            waiting[0] -= 1

    monkeypatch.setattr(socket, "getnameinfo", hangs)
    assert lookup.name_lookups_s("::ffff:10.0.0.5", 4, 0.3) == math.inf
    assert waiting[0] > 0  # it ended at the bound, the resolver's lookups still waiting
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
    hang, asked_dns, answered = threading.Event(), [], []

    def slow_dns(host: str, *args: object, **kwargs: object) -> list[object]:
        asked_dns.append(host)
        hang.wait(60)
        answered.append(host)
        return []

    monkeypatch.setattr(socket, "getaddrinfo", slow_dns)
    assert lookup.slow_lookup_hint("n1", 0.2) is None  # a name DNS cannot resolve in time
    assert asked_dns == ["n1"] and answered == []  # at its bound, the name still resolving
    hang.set()
