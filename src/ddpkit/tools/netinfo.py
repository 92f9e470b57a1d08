"""Network facts without torch (Linux): interfaces, addresses, the backends' choice.

Which interface a backend would use, as the backends decide it:

* gloo: ``GLOO_SOCKET_IFNAME`` when set (its first name); otherwise the address the host name
  resolves to, if a socket can bind it, else loopback (torch's ``createDefaultDevice``). A host
  name that resolves to 127.0.1.1 (Debian's /etc/hosts) gives loopback: fine on one node, a
  hang on several.
* NCCL's socket transport: ``NCCL_SOCKET_IFNAME`` (prefixes; ``^`` excludes, ``=`` exact)
  when set; otherwise the first interface that is up, has an address and is neither ``lo``
  nor ``docker*``, InfiniBand (``ib*``) first. An approximation of NCCL's own search, said so.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ddpkit.cluster.rendezvous.interfaces import Interface, interface_of, interfaces, is_loopback
from ddpkit.cluster.rendezvous.lookup import resolve

__all__ = [
    "Choice",
    "Interface",
    "gloo_choice",
    "interface_of",
    "interfaces",
    "is_loopback",
    "nccl_choice",
    "resolve",
]


@dataclass(frozen=True)
class Choice:
    """The interface (and address) a backend would use, and why; ``interface`` None if none."""

    interface: str | None
    address: str | None
    reason: str

    @property
    def loopback(self) -> bool:
        return self.address is not None and is_loopback(self.address)


def _bindable(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def _named(variable: str, names: str, found: Sequence[Interface]) -> Choice:
    first = names.split(",", maxsplit=1)[0].strip()
    interface = next((i for i in found if i.name == first), None)
    if interface is None:
        known = ", ".join(i.name for i in found)
        return Choice(None, None, f"{variable}={names} names no interface here (have: {known})")
    address = interface.addresses[0] if interface.addresses else None
    return Choice(first, address, f"{variable}={names}")


def gloo_choice(
    env: Mapping[str, str],
    found: Sequence[Interface],
    hostname: str,
    resolver: Callable[[str], list[str]] = resolve,
) -> Choice:
    """The interface gloo would use for this process (see the module docstring)."""
    names = env.get("GLOO_SOCKET_IFNAME", "").strip()
    if names:
        return _named("GLOO_SOCKET_IFNAME", names, found)
    for address in resolver(hostname):
        if _bindable(address):
            return Choice(
                interface_of(address, found),
                address,
                f"the host name {hostname} resolves to {address}",
            )
    return Choice(
        interface_of("127.0.0.1", found),
        "127.0.0.1",
        f"the host name {hostname} resolves to no usable address: loopback",
    )


def _nccl_matches(spec: str, name: str) -> bool:
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    prefixes = [p.strip() for p in spec.lstrip("=").split(",") if p.strip()]
    hit = any(name == p if exact else name.startswith(p) for p in prefixes)
    return hit != exclude


def nccl_choice(env: Mapping[str, str], found: Sequence[Interface]) -> Choice:
    """The interface NCCL's socket transport would most likely use (see the module docstring)."""
    spec = env.get("NCCL_SOCKET_IFNAME", "").strip()
    reason = f"NCCL_SOCKET_IFNAME={spec}" if spec else "NCCL's default: ib* first, not lo/docker*"
    usable = [i for i in found if i.up and _nccl_matches(spec or "^docker,lo", i.name)]
    usable.sort(key=lambda i: not i.name.startswith("ib"))
    if not usable:
        return Choice(None, None, f"{reason}: no interface that is up matches")
    return Choice(usable[0].name, usable[0].addresses[0], reason)
