"""This host's network interfaces and the one a route leaves through (Linux, torch-free).

Read from the kernel (``if_nameindex``, ``SIOCGIFADDR``, ``/proc/net/if_inet6``,
``/sys/class/net``): ``ddpkit doctor`` shows them, and ``ddpkit run`` names the interface of the
route to the rendezvous for its workers' gloo and NCCL (:func:`ddpkit.launch.local.ifname_env`).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddpkit.cluster.rendezvous.lookup import route_to

__all__ = [
    "Interface",
    "interface_of",
    "interfaces",
    "is_loopback",
    "is_this_host",
    "route_interface",
]

_SIOCGIFADDR = 0x8915
_IFF_LOOPBACK = 0x8
_SYS_NET = Path("/sys/class/net")


@dataclass(frozen=True)
class Interface:
    """One network interface: its name, whether it is up and loopback, its addresses."""

    name: str
    up: bool
    loopback: bool
    addresses: tuple[str, ...]


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost`` (names must be resolved first otherwise)."""
    if address.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip().strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def _ipv4(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(
                sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
            )
        except OSError:  # no IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_table() -> dict[str, list[str]]:
    table: dict[str, list[str]] = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return table
    for line in lines:
        fields = line.split()
        if len(fields) == 6:
            address = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
            table.setdefault(fields[5], []).append(address)
    return table


def _sys_flag(name: str, attribute: str) -> str:
    try:
        return (_SYS_NET / name / attribute).read_text().strip()
    except OSError:
        return ""


def interfaces() -> list[Interface]:
    """Every interface of this host (network namespace), in kernel index order."""
    ipv6 = _ipv6_table()
    found = []
    for _, name in sorted(socket.if_nameindex()):
        flags = _sys_flag(name, "flags")
        loopback = bool(int(flags, 16) & _IFF_LOOPBACK) if flags else name == "lo"
        state = _sys_flag(name, "operstate")
        addresses = tuple(a for a in [_ipv4(name), *ipv6.get(name, [])] if a)
        found.append(
            Interface(name, state in ("up", "unknown") and bool(addresses), loopback, addresses)
        )
    return found


def interface_of(address: str, found: Sequence[Interface]) -> str | None:
    """The name of the interface holding ``address`` (loopback for any 127.x), else None."""
    for interface in found:
        if address in interface.addresses:
            return interface.name
    if is_loopback(address):
        return next((i.name for i in found if i.loopback), "lo")
    return None


def route_interface(host: str, found: Sequence[Interface] | None = None) -> Interface | None:
    """The interface the kernel would send from to reach ``host`` (a name or an address; no
    packet is sent), or None when there is no route or the interface cannot be told."""
    try:
        local = route_to(host)  # None where the name does not resolve or nothing routes
    except UnicodeError:  # a name the resolver cannot even encode (idna)
        return None
    if local is None:
        return None
    found = interfaces() if found is None else found
    name = interface_of(local, found)
    return next((interface for interface in found if interface.name == name), None)


def is_this_host(host: str, found: Sequence[Interface] | None = None) -> bool:
    """Whether ``host`` (a name or an address) resolves to an address of this host's
    interfaces: the route to it then says nothing of how the other nodes reach this one."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    mine = {a for i in (interfaces() if found is None else found) for a in i.addresses}
    return any(str(info[4][0]) in mine for info in infos)
