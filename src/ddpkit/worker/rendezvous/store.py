"""Where a job's rendezvous store listens, and how each rank reaches it, every wait bounded.

torch's ``TCPStore`` has no authentication, so a store listens as narrowly as the job allows
(:func:`store_endpoint`): on a loopback MASTER_ADDR, or when every rank is on one node, on
loopback only; otherwise on every interface, as torch does. torch takes no bind address but a
listening socket (``master_listen_fd``): made here.

Connecting is bounded (:func:`connect_client`), with no thread: torch's client waits forever
for a listener that accepts and never answers, and prints pages of C++ retry traces against
one that closes. So a rank first asks for torch's handshake with a socket of its own and a
timeout (:func:`store_answers`); only a store that answered gets torch's client. Anything else
ends, at the connect timeout, in a one-line :class:`RendezvousError` naming the address.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in __all__

from ddpkit import compat
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.contract import CONNECT_TIMEOUT_VAR
from ddpkit.errors import RendezvousError

__all__ = [
    "HANDSHAKE_MIN_S",
    "Connection",
    "NotAStore",
    "connect_client",
    "host_tcp_store",
    "is_taken",
    "loopback_address",
    "own_connection",
    "probe_master",
    "store_address",
    "store_answers",
    "store_endpoint",
]

# The least time torch's client gets once the store answered: it answers in milliseconds (its
# server thread needs no GIL), even when the wait for it used up the whole connect timeout.
HANDSHAKE_MIN_S = 5.0
_LOOPBACK = "127.0.0.1"


# --- where the store listens ---------------------------------------------------------------


def loopback_address(addr: str) -> str | None:
    """The loopback address ``addr`` names (``localhost`` → ``127.0.0.1``), else None. Other
    names are not resolved: one that is loopback here may not be on the other nodes."""
    text = addr.strip().strip("[]")
    if text.lower() == "localhost":
        return _LOOPBACK
    try:
        return text if ipaddress.ip_address(text).is_loopback else None
    except ValueError:
        return None


def store_endpoint(info: RankInfo) -> tuple[str, str | None]:
    """(the address every rank connects to, the address rank 0 binds: None = every interface).
    ``num_nodes`` is the launcher's count, the same on every rank: all decide alike."""
    loopback = loopback_address(info.master_addr)
    if loopback is not None:
        return loopback, loopback
    if info.num_nodes == 1:
        return _LOOPBACK, _LOOPBACK
    return info.master_addr, None


def host_tcp_store(
    addr: str,
    port: int,
    *,
    bind: str | None,
    world_size: int | None,
    timeout: timedelta,
    multi_tenant: bool = False,
    use_libuv: bool = True,
) -> TCPStore:
    """A store server on ``port`` (0: any free one), listening on ``bind`` only (None: every
    interface); ``addr`` is where its own client connects. Raises ``OSError`` or
    ``DistNetworkError`` when the port is taken; waits for no other rank."""
    family = socket.AF_INET6 if bind is not None and ":" in bind else socket.AF_INET
    sock = None if bind is None else socket.socket(family, socket.SOCK_STREAM)
    try:
        if sock is not None:
            # As torch's own listener: a port left in TIME_WAIT by an earlier run is reusable.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind, port))
            sock.listen(socket.SOMAXCONN)
        store = TCPStore(
            addr,
            port if sock is None else sock.getsockname()[1],
            world_size,
            True,
            timeout,
            wait_for_workers=False,
            multi_tenant=multi_tenant,
            master_listen_fd=None if sock is None else sock.fileno(),
            use_libuv=use_libuv,
        )
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if sock is not None:
        sock.detach()  # the store's server owns the descriptor now and closes it
    return store


def is_taken(exc: BaseException) -> bool:
    """True when hosting failed because the port is in use (ours or torch's bind)."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return True
    return isinstance(exc, dist.DistNetworkError) and "EADDRINUSE" in str(exc)


def _retry(attempt: Callable[[float], None], timeout_s: float) -> None:
    """Call ``attempt(bound_s)`` until it returns or ``timeout_s`` ran out (then re-raise its
    last error), backing off from 0.1 s to 1 s between tries."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.1
    while True:
        try:
            return attempt(max(0.1, deadline - time.monotonic()))
        except (OSError, NotAStore):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise
        time.sleep(min(delay_s, remaining))
        delay_s = min(2 * delay_s, 1.0)


def _accepts(addr: str, port: int, bound_s: float) -> None:
    # Leaving the block closes normally (FIN): torch's stores log nothing for that, whereas an
    # abortive close (RST) makes the libuv store print a warning.
    with socket.create_connection((addr, port), timeout=min(5.0, bound_s)):
        pass


def probe_master(info: RankInfo, timeout_s: float) -> None:
    """Wait until ``info.master_addr:master_port`` accepts a TCP connection, or raise a
    :class:`RendezvousError` naming the address (a missing or crashed rank 0)."""
    try:
        _retry(lambda s: _accepts(info.master_addr, info.master_port, s), timeout_s)
    except OSError as exc:
        raise _unreachable(info, timeout_s, exc) from None


def _unreachable(info: RankInfo, timeout_s: float, error: OSError) -> RendezvousError:
    where = f"{info.master_addr}:{info.master_port}"
    return RendezvousError(
        f"rank {info.rank} cannot reach the rendezvous master at MASTER_ADDR={info.master_addr} "
        f"MASTER_PORT={info.master_port} (launcher {info.launcher}) within {timeout_s:g} s: "
        f"{error}",
        hint=(
            f"likely causes: rank 0 has not started or crashed (check its log); a wrong "
            f"MASTER_ADDR (e.g. localhost/127.0.0.1 on a multi-node job: use rank 0's hostname); "
            f"a firewall blocking {where}; port {info.master_port} taken by another job so "
            f"rank 0 could not listen. If rank 0 is only slow, raise {CONNECT_TIMEOUT_VAR}"
        ),
    )


class NotAStore(Exception):
    """Something listens on the store's address that does not answer as a TCPStore does."""


def store_answers(addr: str, port: int, timeout_s: float) -> None:
    """Return once a TCPStore on ``addr:port`` has answered torch's handshake; raise the
    ``OSError`` of a connect that failed, or :class:`NotAStore` (a listener that closed, sent
    something else, or said nothing within ``timeout_s``)."""
    hello, answer = compat.store_ping(os.getpid())
    with socket.create_connection((addr, port), timeout=timeout_s) as sock:
        got = b""
        try:
            sock.sendall(hello)
            while len(got) < len(answer) and (part := sock.recv(len(answer) - len(got))):
                got += part
        except TimeoutError:
            raise NotAStore(f"no answer within {timeout_s:.3g} s") from None
        except OSError as exc:
            raise NotAStore(str(exc)) from None
    if got != answer:
        raise NotAStore("it closed the connection" if not got else f"it answered {got!r}")


def connect_client(info: RankInfo, connect_timeout_s: float, timeout: timedelta) -> TCPStore:
    """This rank's client of the store at ``info.master_addr:master_port``, or a one-line
    :class:`RendezvousError` naming the cause within ``connect_timeout_s``."""
    addr, port = info.master_addr, info.master_port
    deadline = time.monotonic() + connect_timeout_s
    try:
        _retry(lambda s: store_answers(addr, port, s), connect_timeout_s)
    except NotAStore as exc:
        raise _not_a_store(info, exc) from None
    except OSError as exc:
        raise _unreachable(info, connect_timeout_s, exc) from None
    return _client(addr, port, max(HANDSHAKE_MIN_S, deadline - time.monotonic()), timeout)


def _not_a_store(info: RankInfo, error: NotAStore) -> RendezvousError:
    addr, port = info.master_addr, info.master_port
    return RendezvousError(
        f"rank {info.rank} (launcher {info.launcher}): something on {addr}:{port} accepts "
        "connections but does not speak the TCPStore protocol "
        f"({' '.join(str(error).split())[:200]})",
        hint=(
            f"another service holds port {port} on {addr}? (`ss -ltnp 'sport = :{port}'` "
            "there names it); give the job a free MASTER_PORT, or check rank 0's log in case it "
            "crashed while this rank connected"
        ),
    )


def _client(addr: str, port: int, connect_s: float, timeout: timedelta) -> TCPStore:
    """torch's client, retrying for ``connect_s``; ``timeout`` then for its operations. No
    world size: that adds a check-in key only a host with ``wait_for_workers=True`` reads."""
    client = TCPStore(addr, port, None, False, timedelta(seconds=connect_s))
    client.set_timeout(timeout)
    return client


def _store_of(store: Any) -> Any:
    """The store under ``store``'s prefixes (``default_pg/``, torchrun's ``/worker/attempt_N``)."""
    inner: Any = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    return inner


def store_address(store: Any) -> str:
    inner = _store_of(store)
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    return type(inner).__name__ if host is None or port is None else f"{host}:{port}"


@dataclass
class Connection:
    """The store under a prefix; ``cut`` ends an operation in flight; ``closed``: by the host?"""

    store: Any
    cut: Callable[[], None]
    closed: Callable[[], bool]


def own_connection(base: Any, prefix: str, op_timeout_s: float) -> Connection | None:
    """The peer watchdog's own client of ``base``'s TCPStore (never queued behind the program's
    calls), each operation bounded by its socket's timeouts (torch bounds only waits for a key);
    None when it is no TCPStore, the connect fails, or its socket cannot be told apart."""
    from torch.distributed.distributed_c10d import PrefixStore

    raw = _store_of(base)
    if not isinstance(raw, TCPStore):
        return None
    before = _sockets()
    try:
        store_answers(raw.host, raw.port, op_timeout_s)
        own = _client(raw.host, raw.port, op_timeout_s, timedelta(seconds=op_timeout_s))
    except Exception:
        return None
    socks = [s for i, fd in _sockets().items() if i not in before and (s := _peer(fd, raw.port))]
    if len(socks) != 1:
        return None
    (sock,) = socks  # a duplicate of torch's descriptor: the same socket
    timeout = struct.pack("ll", int(op_timeout_s), int(op_timeout_s % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)

    def cut() -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    def closed() -> bool:  # between operations nothing is to be read: readable means closed
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    return Connection(PrefixStore(prefix, own), cut, closed)  # which keeps ``own`` alive


def _sockets() -> dict[str, int]:
    """This process's sockets: ``socket:[inode]`` -> fd (Linux; empty elsewhere)."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:"):
                    found[target] = int(name)
    return found


def _peer(fd: int, port: int) -> socket.socket | None:
    """A socket over a duplicate of ``fd``, if that is connected to ``port``."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fd))
        with contextlib.suppress(OSError):
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.getpeername()[1] == port:
                return sock
        sock.close()
    return None
