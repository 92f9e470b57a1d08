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

Connecting is bounded at each step (:func:`connect_client`). torch's client is made in a
daemon thread: against a store that is up, the only connection a rank opens for it. A client
not made within :func:`client_grace_s` brings in a plain TCP connect (closed at once): a master
that listens is only slow, and is waited for; when nothing listens, :func:`probe_master` finds
a late master sooner than torch's back-off and, at the connect timeout, names a master that is
not there. torch's client validates and pings the server and
waits for its reply with no bound at all, so a port held by something that accepts connections
but never answers would hold a rank forever: the thread is given up after a bound, naming the
address as "accepts connections but does not speak the TCPStore protocol". The thread stays
blocked on that listener (one per attempt; it does not keep the process alive).

The port search of a SLURM step without MASTER_PORT (host on the first candidate that binds,
find the store that answers with the job's identity) is in
:mod:`ddpkit.worker.rendezvous.portsearch`.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in __all__

from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.contract import CONNECT_TIMEOUT_VAR
from ddpkit.errors import RendezvousError
from ddpkit.worker.rendezvous.waits import Call

__all__ = [
    "CLIENT_GRACE_PER_RANK_S",
    "CLIENT_GRACE_S",
    "CLIENT_QUIET_S",
    "CONNECT_TIMEOUT_VAR",
    "HANDSHAKE_MIN_S",
    "client_grace_s",
    "connect_client",
    "connect_thread_name",
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
# How long a rank's client may take before a probe looks at the master (see connect_client):
# against a store that is up it is made in milliseconds, plus ~1 ms a rank when every rank
# connects at once (torch's libuv store took 96K ranks in ~100 s): client_grace_s.
CLIENT_GRACE_S = 2.0
CLIENT_GRACE_PER_RANK_S = 0.001
# How long past the connect timeout torch's first client of a rank keeps retrying (quietly).
CLIENT_QUIET_S = 30.0
_LOOPBACK = "127.0.0.1"


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
    deadline: float | None = None,
) -> None:
    """Wait until ``info.master_addr:master_port`` accepts a TCP connection, or raise.

    A missing or crashed rank 0 becomes a :class:`RendezvousError` naming the address instead
    of a long silent wait inside torch (pytorch#118369, #116974). ``deadline`` (on ``clock``)
    ends the wait sooner, when part of ``timeout_s`` (the one the error names) went before.
    """
    deadline = clock() + timeout_s if deadline is None else deadline
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


def connect_client(info: RankInfo, connect_timeout_s: float, timeout: timedelta) -> TCPStore:
    """This rank's client of the store at ``info.master_addr:master_port``, or a
    :class:`RendezvousError` naming the cause within ``connect_timeout_s`` (and at least
    :data:`HANDSHAKE_MIN_S` for a handshake that began late).

    torch's client is made first, in a thread: against a store that is up, the one connection
    a rank needs (no probe beside it: at 4,096 simulated ranks a probe's connect and the
    client's, back to back, overflowed a listen queue of 4,096). Only a client not made within
    :func:`client_grace_s` brings in a TCP connect. When the master listens then, the client
    is only slow (a busy store) or talks to something that is not a store: it is waited for,
    with no second connection to load that store more. When nothing listens,
    :func:`probe_master` finds a late master sooner than torch's retries (they back off to
    seconds: a master 12 s late was found after 18.7 s), which then gets a second client,
    bounded as before (the first, still in its back-off, connects later and is dropped), or
    names a missing one at the deadline. torch's own client gives up (and prints its C++
    traces) only :data:`CLIENT_QUIET_S` past the deadline, when the rank has reported the cause
    and, as a rank that cannot join does, ended.
    """
    addr, port = info.master_addr, info.master_port
    name = connect_thread_name(port)
    deadline = time.monotonic() + connect_timeout_s
    wake = threading.Event()
    quiet_s = connect_timeout_s + CLIENT_QUIET_S
    calls = [Call(lambda: _client(addr, port, quiet_s, timeout), name, wake)]
    wake.wait(min(client_grace_s(info.world_size), connect_timeout_s))
    if (made := _made(calls)) is not None:
        return made
    # Not made yet: the master is late or missing (torch's client then sleeps in its back-off),
    # the store is slow to answer, or something else holds the port. One TCP connect tells.
    if try_connect(addr, port, min(5.0, max(0.1, deadline - time.monotonic()))) is not None:

        def nap(seconds: float) -> None:  # a client made meanwhile ends the nap
            if wake.is_set():
                time.sleep(seconds)
            else:
                wake.wait(seconds)

        try:
            probe_master(info, connect_timeout_s, sleep=nap, deadline=deadline)
        except RendezvousError:
            # Nothing listened until the deadline: torch's client is in its back-off and prints
            # nothing before CLIENT_QUIET_S from now; a rank that exits is not held 3 s for it.
            calls[0].give_up(wait_at_exit=False)
            raise
        if (made := _made(calls)) is not None:
            return made
        # The master came up after the grace: torch's client may sleep in its back-off for
        # seconds yet, a second one joins now. torch's client retries a listener that closes
        # or answers garbage until its timeout (and a try or two past it): half the bound, so
        # those end with torch's own error and only a client blocked on a silent listener
        # outlives the bound.
        bound_s = max(HANDSHAKE_MIN_S, deadline - time.monotonic())
        wake.clear()
        second = Call(lambda: _client(addr, port, bound_s / 2, timeout), name, wake)
        calls.append(second)
    else:  # it listens: the client is slow (a busy store) or talks to something else; no second
        bound_s = max(HANDSHAKE_MIN_S, deadline - time.monotonic())
    ends = time.monotonic() + bound_s
    while (made := _made(calls)) is None and time.monotonic() < ends:
        if all(call.outcome is not None for call in calls):
            break  # both failed
        wake.wait(max(0.0, ends - time.monotonic()))
        wake.clear()
    if made is not None:
        return made
    outcomes = [call.give_up() for call in calls]
    errors = [outcome.error for outcome in reversed(outcomes) if outcome.error is not None]
    why = f"torch's client: {_one_line(errors[0])}" if errors else f"no answer within {bound_s:g} s"
    raise RendezvousError(
        f"rank {info.rank} (launcher {info.launcher}): something on {addr}:{port} accepts "
        f"connections but does not speak the TCPStore protocol ({why})",
        hint=(
            f"another service holds port {port} on {addr}? (`ss -ltnp 'sport = :{port}'` "
            "there names it); give the job a free MASTER_PORT, or check rank 0's log in case it "
            "crashed while this rank connected"
        ),
    )


def connect_thread_name(port: int) -> str:
    """The name of the threads that make a rank's clients of the store on ``port``."""
    return f"ddpkit-store-connect-{port}"


def client_grace_s(world_size: int) -> float:
    """How long a rank's client may take before a probe looks at the master: the store takes
    every rank's connect at about torch's pace, so a large job's ranks are not all counted
    late (each would add a connection to a store already busy with them all)."""
    return CLIENT_GRACE_S + CLIENT_GRACE_PER_RANK_S * max(0, world_size - 1)


def _client(addr: str, port: int, connect_s: float, timeout: timedelta) -> TCPStore:
    """torch's client, retrying for ``connect_s``; ``timeout`` then for its operations.

    Not given the world size: torch's client would then add to a check-in key (``init/``) that
    only a host made with ``wait_for_workers=True`` reads. ddpkit's host waits on no key (the
    group's forming is the barrier) and torchrun's agent store is past its own wait before any
    worker starts: one round trip a rank at the store every rank shares, for nothing.
    """
    client = TCPStore(addr, port, None, False, timedelta(seconds=connect_s))
    client.set_timeout(timeout)
    return client


def _made(calls: list[Call[TCPStore]]) -> TCPStore | None:
    """The first client made of ``calls``, if any; the others still running are given up (a
    late master's first client, in torch's back-off, connects later: the exit waits for it a
    little, as for any call given up)."""
    for call in calls:
        if (outcome := call.outcome) is not None and outcome.value is not None:
            for other in calls:
                if other is not call and other.outcome is None:
                    other.give_up()
            return outcome.value
    return None
