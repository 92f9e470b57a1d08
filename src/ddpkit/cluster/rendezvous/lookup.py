"""How long the resolver takes to name this host's address, as torch's store client asks.

torch's client looks up the name of its socket's address (``getnameinfo``) when it connects,
once a process, in its IPv4-mapped form (``::ffff:127.0.0.1``), which a hosts file's
``127.0.0.1`` line does not match: where DNS does not answer, that first connect waits for the
resolver's timeout (10 s by default). ``ddpkit doctor`` checks it; ``ddpkit.init`` names it
when a rank's start was slow. Torch-free.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import socket
import threading
import time

__all__ = [
    "SLOW_LOOKUP_S",
    "name_lookups_s",
    "resolve",
    "route_to",
    "slow_lookup_hint",
    "torch_socket_address",
]

SLOW_LOOKUP_S = 0.5  # a lookup this slow is the resolver's timeout, not its work


def resolve(host: str, bound_s: float = 5.0) -> list[str]:
    """The addresses ``host`` resolves to (IPv4 first), or [] when it does not within bound_s
    (a broken resolver can block for long: the lookup runs in a thread)."""
    found: list[str] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return
        found.extend(dict.fromkeys(str(info[4][0]) for info in infos))

    thread = threading.Thread(target=lookup, name="ddpkit-resolve", daemon=True)
    thread.start()
    thread.join(bound_s)
    return sorted(found, key=lambda a: ":" in a) if not thread.is_alive() else []


def route_to(address: str) -> str | None:
    """The local address the kernel would send from to reach ``address`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))  # UDP connect only picks the route
        except OSError:
            return None
        local: str = sock.getsockname()[0]
    return local


def torch_socket_address(local: str) -> str:
    """The form of this host's address ``local`` that torch's store client names: the mapped
    one (``::ffff:10.0.0.5``) for an IPv4 address, an IPv6 one without its zone."""
    try:
        parsed = ipaddress.ip_address(local.strip("[]").split("%")[0])
    except ValueError:
        return local
    return f"::ffff:{parsed}" if parsed.version == 4 else str(parsed)


def name_lookups_s(address: str, count: int, bound_s: float) -> float:
    """Seconds until ``count`` reverse lookups of ``address`` made at once all came back (with a
    name or a refusal), as a node's ranks make them when they connect; inf when some had not
    within ``bound_s`` (their threads are left to the resolver's own timeout)."""
    back = threading.Semaphore(0)

    def lookup() -> None:
        with contextlib.suppress(OSError):  # a refusal is an answer: only the wait matters
            socket.getnameinfo((address, 0), socket.NI_NAMEREQD)
        back.release()

    start = time.monotonic()
    for _ in range(count):
        threading.Thread(target=lookup, name="ddpkit-name-lookup", daemon=True).start()
    for _ in range(count):
        if not back.acquire(timeout=max(0.0, start + bound_s - time.monotonic())):
            return math.inf
    return time.monotonic() - start


def slow_lookup_hint(master_addr: str, bound_s: float = 1.0) -> str | None:
    """What to say when one lookup of this host's address toward ``master_addr``, in the form
    torch's client names it, takes :data:`SLOW_LOOKUP_S` or more; None when it is answered
    sooner, or when the route cannot be told within ``bound_s`` (a host name resolved first).
    At most 2 x ``bound_s``."""
    resolved = resolve(master_addr, bound_s)
    local = route_to(resolved[0]) if resolved else None
    if local is None:
        return None
    named = torch_socket_address(local)
    took = name_lookups_s(named, 1, bound_s)
    if took < SLOW_LOOKUP_S:
        return None
    waited = f"over {bound_s:g} s" if took == math.inf else f"{took:.1f} s"
    return (
        f"the resolver took {waited} to name {named}, which torch's store client looks up when "
        f"it connects (its warning: 'The hostname of the client socket cannot be retrieved'); "
        f"add a line '{named} {socket.gethostname()}' to /etc/hosts on every node, or have "
        "DNS answer reverse lookups for it at once (`ddpkit doctor` checks it)"
    )
