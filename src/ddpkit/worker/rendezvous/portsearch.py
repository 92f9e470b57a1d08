"""The port search of a SLURM step without MASTER_PORT (and of ``ddpkit run``'s c10d port).

:func:`host_store` hosts on the first candidate that binds and publishes the search's identity
under :data:`IDENTITY_KEY`; :func:`find_store` joins the first candidate whose store answers
with it, skipping a port held by another job's store, a stale one, or a listener that is no
store (asked with :func:`~ddpkit.worker.rendezvous.store.store_answers` first, bounded). The
candidates are :mod:`ddpkit.cluster.rendezvous.ports`'s.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in __all__

from ddpkit.cluster.rendezvous.ports import PortSearch
from ddpkit.contract import CONNECT_TIMEOUT_VAR
from ddpkit.errors import RendezvousError
from ddpkit.worker.rendezvous.store import (
    NotAStore,
    host_tcp_store,
    is_taken,
    store_answers,
)

__all__ = ["IDENTITY_KEY", "find_store", "host_store"]

# Where rank 0 publishes the job's identity in its store.
IDENTITY_KEY = "ddpkit/job"
# How long one candidate may take to prove it is this job's store before it is skipped for now.
_IDENTITY_BOUND_S = 2.0


def host_store(
    addr: str,
    search: PortSearch,
    timeout: timedelta,
    *,
    world_size: int | None = None,
    multi_tenant: bool = False,
    share: bool = False,
    bind: str | None = None,
) -> tuple[TCPStore, int]:
    """Host the store on the first candidate port that binds; publish the search's identity.
    ``multi_tenant``: a store torch opens later on that port in this process shares its server;
    ``share``: a taken port whose store answers with the identity is joined as a client."""
    taken: list[str] = []
    for port in search.ports:
        try:
            store = host_tcp_store(
                addr,
                port,
                bind=bind,
                world_size=world_size,
                timeout=timeout,
                multi_tenant=multi_tenant,
            )
        except (OSError, dist.DistNetworkError) as exc:
            if not is_taken(exc):
                raise _unhostable(addr, search, f"port {port}: {exc}") from exc
            if share:
                client, answer = _ask_identity(addr, port, _IDENTITY_BOUND_S)
                if client is not None and answer == search.identity:
                    client.set_timeout(timeout)
                    return client, port
            taken.append(str(port))
            continue
        store.set(IDENTITY_KEY, search.identity)
        return store, port
    raise _unhostable(addr, search, f"every candidate port is taken ({', '.join(taken)})")


def _unhostable(addr: str, search: PortSearch, why: str) -> RendezvousError:
    return RendezvousError(
        f"the rendezvous store of {search.identity} could not be hosted on {addr}: {why}",
        hint="free one of these ports on that node, or give the job a fixed free port "
        "(MASTER_PORT for srun steps, rdzv_port for launch: torchrun)",
    )


def find_store(
    addr: str,
    search: PortSearch,
    timeout_s: float,
    timeout: timedelta,
    *,
    who: str,
) -> tuple[TCPStore, int]:
    """The first candidate on ``addr`` whose store answers with the search's identity, passing
    over the candidates until ``timeout_s`` runs out (the host may start later); ``who`` names
    the caller in the error."""
    deadline = time.monotonic() + timeout_s
    seen: dict[int, str] = {}
    delay_s = 0.1
    while True:
        for port in search.ports:
            bound_s = min(_IDENTITY_BOUND_S, max(0.1, deadline - time.monotonic()))
            store, answer = _ask_identity(addr, port, bound_s)
            if store is not None and answer == search.identity:
                store.set_timeout(timeout)
                return store, port
            seen[port] = f"the store of {answer}" if store is not None else answer
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _not_found(who, addr, search, timeout_s, seen)
        time.sleep(min(delay_s, remaining))
        delay_s = min(2 * delay_s, 1.0)


def _ask_identity(addr: str, port: int, bound_s: float) -> tuple[TCPStore | None, str]:
    """(client, the identity its store holds), or (None, why not), within about 2 ``bound_s``."""
    try:
        store_answers(addr, port, bound_s)
    except ConnectionRefusedError:
        return None, "nothing listening"
    except OSError as exc:
        return None, str(exc)
    except NotAStore as exc:
        return None, f"a listener that is not a store ({exc})"
    ends = time.monotonic() + bound_s
    try:  # a store answered: torch's client connects at once
        client = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=bound_s))
        # its host publishes the identity right after it listens; check, not wait: a wait
        # that times out prints torch's warnings
        while not client.check([IDENTITY_KEY]):
            if time.monotonic() >= ends:
                return None, "a store without ddpkit's identity"
            time.sleep(0.05)
        return client, client.get(IDENTITY_KEY).decode(errors="replace")
    except RuntimeError as exc:  # DistError and all: not (yet) this job's store
        return None, f"a store without ddpkit's identity ({type(exc).__name__})"


def _not_found(
    who: str, addr: str, search: PortSearch, timeout_s: float, seen: Mapping[int, str]
) -> RendezvousError:
    found = "; ".join(f"{port}: {what}" for port, what in seen.items())
    return RendezvousError(
        f"{who} found no rendezvous store of {search.identity} at {addr} within "
        f"{timeout_s:g} s (ports tried: {found})",
        hint=(
            "likely causes: the host of the store (rank 0, or the first node's `ddpkit run`) "
            "has not started or crashed (check its log); a wrong MASTER_ADDR or "
            f"DDPKIT_HOST_TEMPLATE; a firewall. If it is only slow, raise {CONNECT_TIMEOUT_VAR}"
        ),
    )
