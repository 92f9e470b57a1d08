"""The store of a process group: which one each rank makes or reaches, every wait bounded.

:mod:`ddpkit.worker.process_group` hands it to ``init_process_group(store=...)``, so ddpkit
decides where it listens and bounds every wait of joining it: a world of one gets an
in-process ``HashStore`` (nothing listens on the network); rank 0 hosts a ``TCPStore`` where
:func:`~ddpkit.worker.rendezvous.store.store_endpoint` says (under torchrun's agent store the
agent hosts it); a client connects with
:func:`~ddpkit.worker.rendezvous.store.connect_client`. A SLURM step without MASTER_PORT
searches its port (:mod:`ddpkit.worker.rendezvous.portsearch`).

Before that a rank raises its open-files limit to what the job's size needs
(:mod:`ddpkit.cluster.limits`). A node's first rank whose store took :data:`SLOW_STORE_S` or
more looks at the resolver once (:mod:`ddpkit.cluster.rendezvous.lookup`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]  # public, not in __all__
from torch.distributed.distributed_c10d import Store

from ddpkit.cluster.limits import (
    launcher_shortfall,
    open_files_needed,
    open_files_of,
    raise_open_files,
)
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.cluster.rendezvous.lookup import slow_lookup_hint
from ddpkit.errors import RendezvousError
from ddpkit.worker.rendezvous.portsearch import find_store, host_store
from ddpkit.worker.rendezvous.store import (
    connect_client,
    host_tcp_store,
    is_taken,
    store_endpoint,
)

__all__ = ["AGENT_STORE_VAR", "make_store", "uses_agent_store"]

# Set by torchrun's agent for its workers: "True" when the agent hosts the store they share.
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
# A store this slow to make on a node's first rank has its resolver looked at (one lookup, 1 s
# at most): a connect takes milliseconds, a resolver that does not answer 10 s.
SLOW_STORE_S = 3.0


def uses_agent_store(info: RankInfo, env: Mapping[str, str]) -> bool:
    """True when torchrun's agent hosts the store and rank 0 is one of its clients."""
    return info.launcher == "torchrun" and env.get(AGENT_STORE_VAR) == str(True)


def make_store(
    info: RankInfo, env: Mapping[str, str], connect_timeout_s: float, timeout: timedelta
) -> tuple[Store, RankInfo]:
    """This rank's store of the group (see the module docstring), and ``info`` with the address
    and port actually used (another port only after a port search; 127.0.0.1 when every rank
    is on one node). ``timeout`` is the store's own timeout for later operations."""
    if info.world_size == 1:
        return HashStore(), info  # nobody else to meet: nothing listens for it
    started = time.monotonic()
    made = _make_store(info, env, connect_timeout_s, timeout)
    took_s = time.monotonic() - started
    if info.local_rank == 0 and took_s >= SLOW_STORE_S:  # one warning a node: the resolver?
        hint = slow_lookup_hint(info.master_addr)
        if hint is not None:
            text = f"ddpkit: rank {info.rank}'s rendezvous store took {took_s:.1f} s: {hint}"
            warnings.warn(text, RuntimeWarning, stacklevel=2)
    return made


def _make_store(
    info: RankInfo, env: Mapping[str, str], connect_timeout_s: float, timeout: timedelta
) -> tuple[Store, RankInfo]:
    hosts = info.rank == 0 and not uses_agent_store(info, env)
    _fit_open_files(info, env, hosts_store=hosts)
    addr, bind = store_endpoint(info)
    info = dataclasses.replace(info, master_addr=addr)
    search = info.port_search
    if search is not None:
        if info.rank == 0:
            hosted, port = host_store(addr, search, timeout, world_size=info.world_size, bind=bind)
        else:
            who = f"rank {info.rank}"
            hosted, port = find_store(addr, search, connect_timeout_s, timeout, who=who)
        return hosted, dataclasses.replace(info, master_port=port)
    if hosts:
        return _host(info, bind, timeout, env), info
    return connect_client(info, connect_timeout_s, timeout), info


def _fit_open_files(info: RankInfo, env: Mapping[str, str], *, hosts_store: bool) -> None:
    """Raise this rank's open-files limit to what its job's size needs
    (:mod:`ddpkit.cluster.limits`); one warning a node (and on the store's host) when the hard
    limit stops it short. Under torchrun's agent store, rank 0 warns when its parent (the agent
    of its node, which hosts the store every rank connects to) has fewer than a host needs."""
    limits = raise_open_files(open_files_needed(info.world_size, hosts_store))
    if limits.short and (hosts_store or info.local_rank == 0):
        warnings.warn(limits.warning(info.world_size), RuntimeWarning, stacklevel=3)
    if info.rank != 0 or not uses_agent_store(info, env):
        return
    launcher = os.getppid()
    found = open_files_of(launcher)
    short = None if found is None else launcher_shortfall(info.world_size, launcher, *found)
    if short is not None:
        what, fix = short
        text = f"ddpkit: {what}: expect 'Too many open files' as ranks connect; {fix}"
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def _host(info: RankInfo, bind: str | None, timeout: timedelta, env: Mapping[str, str]) -> Store:
    """Rank 0's store, as torch's ``env://`` makes it (multi-tenant, libuv unless
    ``USE_LIBUV=0``), listening on ``bind`` only when that is set."""
    try:
        return host_tcp_store(
            info.master_addr,
            info.master_port,
            bind=bind,
            world_size=info.world_size,
            timeout=timeout,
            multi_tenant=True,
            use_libuv=env.get("USE_LIBUV", "1") == "1",
        )
    except (OSError, dist.DistNetworkError) as exc:
        port = info.master_port
        raise RendezvousError(
            f"rank 0 could not host the rendezvous store at {bind or '*'}:{port} "
            f"(MASTER_ADDR={info.master_addr} MASTER_PORT={port}, launcher {info.launcher}): "
            f"{' '.join(str(exc).split())}",
            hint=(
                f"port {port} is taken (another job on this node?): set MASTER_PORT to a free "
                "port, or let ddpkit derive one per job"
                if is_taken(exc)
                else "check that MASTER_ADDR names this host"
            ),
        ) from exc
