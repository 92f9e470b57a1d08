"""The TCP sockets a process listens on, read from /proc (Linux): no ``ss``, no psutil.

``listening(pid)`` matches the socket inodes among ``/proc/<pid>/fd`` against the LISTEN rows
of ``/proc/<pid>/net/tcp`` and ``tcp6`` and returns ``(address, port)`` pairs, the address as
Python's ``ipaddress`` writes it (``0.0.0.0`` and ``::`` are every interface).
"""

from __future__ import annotations

import ipaddress
import os

__all__ = ["WILDCARDS", "is_loopback", "listening"]

WILDCARDS = frozenset({"0.0.0.0", "::"})
_LISTEN = "0A"  # TCP_LISTEN in the kernel's st column


def _socket_inodes(pid: str) -> set[str]:
    inodes: set[str] = set()
    folder = f"/proc/{pid}/fd"
    for name in os.listdir(folder):
        try:
            target = os.readlink(f"{folder}/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6} write each 32-bit word of the address in host (little-endian) order."""
    words = [bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    return str(ipaddress.ip_address(b"".join(words)))


def listening(pid: int | str = "self") -> list[tuple[str, int]]:
    """Every ``(address, port)`` process ``pid`` listens on (TCP, IPv4 and IPv6), sorted."""
    inodes = _socket_inodes(str(pid))
    found: list[tuple[str, int]] = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as rows:
            next(rows)  # the header
            for row in rows:
                fields = row.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    address, port = fields[1].split(":")
                    found.append((_address(address), int(port, 16)))
    return sorted(found)


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def routable_interface() -> tuple[str, str] | None:
    """``(name, IPv4 address)`` of a network interface that is up and not loopback, or None."""
    import fcntl
    import socket
    import struct

    siocgifaddr = 0x8915  # linux/sockios.h
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), siocgifaddr, request)
            except OSError:  # down, or no IPv4 address
                continue
            address = socket.inet_ntoa(answer[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                return name, address
    return None
