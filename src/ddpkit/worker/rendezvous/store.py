"""Where a job's rendezvous store listens, and how each rank reaches it, every wait bounded.

torch's ``TCPStore`` has no authentication: whoever reaches its port can read and write every
key of the job (and so disturb or impersonate its ranks). ``ddpkit.init`` therefore gives a
world of one no network store at all (an in-process ``HashStore``, see
:mod:`ddpkit.worker.rendezvous.group`), and a larger world's store listens as narrowly as the job
allows (:func:`store_endpoint`):

* MASTER_ADDR a loopback address (``127.0.0.1``, any ``127.x.y.z``, ``::1``, ``localhost``):
  the store listens on that address only, and every rank connects there;
* every rank on one node (the launcher's node count is 1): it listens on ``127.0.0.1`` and
  every rank connects there, whatever MASTER_ADDR names;
* otherwise on every interface, as torch does: the other nodes must reach it, and a host name
  may resolve to a different address on each node.

torch's ``TCPStore`` takes no bind address; it takes an already-listening socket
(``master_listen_fd``, a public parameter), so the loopback listener is made here and handed
over. A store torch opens later on the same port in this process with ``multi_tenant=True``
shares that server, whatever host name it is given.

Connecting is bounded at each step. The TCP connect is :func:`probe_master`'s; torch's client
then validates and pings the server and waits for its reply with no bound at all, so a port held
by something that accepts connections but never answers would hold a rank forever:
:func:`connect_client` makes the client in a daemon thread and gives up after a bound, naming
the address as "accepts connections but does not speak the TCPStore protocol". The thread
stays blocked on that listener (one per attempt; it does not keep the process alive).

The port search of a SLURM step without MASTER_PORT (host on the first candidate that binds,
find the store that answers with the job's identity) is in
:mod:`ddpkit.worker.rendezvous.portsearch`.
"""

from __future__ import annotations

import atexit
import errno
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, TypeVar

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in __all__

from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.contract import CONNECT_TIMEOUT_VAR
from ddpkit.errors import RendezvousError

__all__ = [
    "CONNECT_TIMEOUT_VAR",
    "HANDSHAKE_MIN_S",
    "Outcome",
    "bounded",
    "connect_client",
    "host_tcp_store",
    "is_taken",
    "loopback_address",
    "probe_master",
    "store_endpoint",
    "try_connect",
]

# The least time a client gets for torch's handshake once the TCP connect succeeded: a real
# store answers in milliseconds (its server thread needs no GIL), even when the connect used
# up the whole connect timeout.
HANDSHAKE_MIN_S = 5.0
_LOOPBACK = "127.0.0.1"
# Bounded calls still running (see bounded), and how long the exit waits for them in all.
_PENDING: list[threading.Thread] = []
_EXIT_WAIT_S = 3.0

T = TypeVar("T")


# --- where the store listens ---------------------------------------------------------------


def loopback_address(addr: str) -> str | None:
    """The loopback address ``addr`` names (``localhost`` → ``127.0.0.1``), else None.

    Host names other than ``localhost`` are not resolved: a name that resolves to loopback
    here (a Debian ``127.0.1.1`` line) may resolve to the real address on the other nodes.
    """
    text = addr.strip().strip("[]")
    if text.lower() == "localhost":
        return _LOOPBACK
    try:
        return text if ipaddress.ip_address(text).is_loopback else None
    except ValueError:
        return None


def store_endpoint(info: RankInfo) -> tuple[str, str | None]:
    """(the address every rank connects to, the address rank 0 binds: None = every interface).

    See the module docstring. ``num_nodes`` is the launcher's count, the same on every rank,
    so every rank takes the same decision.
    """
    loopback = loopback_address(info.master_addr)
    if loopback is not None:
        return loopback, loopback
    if info.num_nodes == 1:
        return _LOOPBACK, _LOOPBACK
    return info.master_addr, None


def _listen_socket(bind: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As torch's own listener: a port left in TIME_WAIT by an earlier run is reusable.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


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
    """A store server on ``port`` (0: any free one), listening on ``bind`` only (None: on every
    interface). ``addr`` is the address its own client and ``clone()`` connect to.

    Raises ``OSError`` (``EADDRINUSE``) or torch's ``DistNetworkError`` when the port is taken.
    Does not wait for the other ranks: they find the server when they connect.
    """
    if bind is None:
        return TCPStore(
            addr,
            port,
            world_size,
            True,
            timeout,
            wait_for_workers=False,
            multi_tenant=multi_tenant,
            use_libuv=use_libuv,
        )
    sock = _listen_socket(bind, port)
    try:
        store = TCPStore(
            addr,
            sock.getsockname()[1],
            world_size,
            True,
            timeout,
            wait_for_workers=False,
            multi_tenant=multi_tenant,
            master_listen_fd=sock.fileno(),
            use_libuv=use_libuv,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now and closes it
    return store


def is_taken(exc: BaseException) -> bool:
    """True when hosting failed because the port is in use (ours or torch's bind)."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return True
    return isinstance(exc, dist.DistNetworkError) and "EADDRINUSE" in str(exc)


# --- bounded waits --------------------------------------------------------------------------


@dataclass
class Outcome(Generic[T]):
    value: T | None = None
    error: Exception | None = None
    pending: threading.Thread | None = None  # the call had not returned when the bound ran out


def bounded(call: Callable[[], T], bound_s: float, name: str) -> Outcome[T]:
    """``call()`` in a daemon thread, waited for ``bound_s`` at most.

    A call still running then is waited for again at exit, a little: a daemon thread that
    comes back from torch's C++ code while the interpreter finalizes aborts the process
    (SIGABRT, "terminate called without an active exception") after the error was printed.
    One blocked for good on a silent listener does no harm: the exit ends it.
    """
    box: list[Outcome[T]] = []

    def run() -> None:
        try:
            box.append(Outcome(value=call()))
        except Exception as exc:  # reported to the caller, who names the address
            box.append(Outcome(error=exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(bound_s)
    if box:
        return box[0]
    if not _PENDING:
        atexit.register(_wait_for_pending)
    _PENDING.append(thread)
    return Outcome(pending=thread)


def _wait_for_pending() -> None:
    deadline = time.monotonic() + _EXIT_WAIT_S
    for thread in _PENDING:
        thread.join(max(0.0, deadline - time.monotonic()))


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def try_connect(addr: str, port: int, timeout_s: float) -> OSError | None:
    try:
        # Leaving the block closes normally (FIN): torch's stores, libuv or classic, log nothing
        # for that, whereas an abortive close (RST) makes the libuv store print a warning.
        with socket.create_connection((addr, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return exc
    return None


def probe_master(
    info: RankInfo,
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait until ``info.master_addr:master_port`` accepts a TCP connection, or raise.

    A missing or crashed rank 0 becomes a :class:`RendezvousError` naming the address instead
    of a long silent wait inside torch (pytorch#118369, #116974).
    """
    deadline = clock() + timeout_s
    delay_s = 0.1
    while True:
        error = try_connect(
            info.master_addr, info.master_port, min(5.0, max(0.1, deadline - clock()))
        )
        if error is None:
            return
        remaining = deadline - clock()
        if remaining <= 0:
            raise _unreachable(info, timeout_s, error)
        sleep(min(delay_s, remaining))
        delay_s = min(2 * delay_s, 1.0)


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


def connect_client(
    addr: str,
    port: int,
    *,
    world_size: int | None,
    timeout: timedelta,
    bound_s: float,
    who: str,
) -> TCPStore:
    """A client of the store at ``addr:port`` (which accepts TCP connections: probe first), or
    a :class:`RendezvousError` within ``bound_s`` when what answers there is not a store.

    ``timeout`` is the client's own timeout for later operations; ``who`` (e.g. ``rank 1
    (launcher torchrun)``) opens the error message.
    """

    def connect() -> TCPStore:
        # torch retries against a listener that closes or answers garbage until its timeout
        # (and a try or two past it): half the bound, so those end with torch's own error
        # and only a client blocked on a silent listener outlives the bound.
        client = TCPStore(addr, port, world_size, False, timedelta(seconds=bound_s / 2))
        client.set_timeout(timeout)
        return client

    outcome = bounded(connect, bound_s, f"ddpkit-store-connect-{port}")
    if outcome.value is not None:
        return outcome.value
    why = (
        f"no answer within {bound_s:g} s"
        if outcome.error is None
        else f"torch's client: {_one_line(outcome.error)}"
    )
    raise RendezvousError(
        f"{who}: something on {addr}:{port} accepts connections but does not speak the "
        f"TCPStore protocol ({why})",
        hint=(
            f"another service holds port {port} on {addr}? (`ss -ltnp 'sport = :{port}'` "
            "there names it); give the job a free MASTER_PORT, or check rank 0's log in case it "
            "crashed while this rank connected"
        ),
    )
