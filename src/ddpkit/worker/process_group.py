"""Joining the torch.distributed process group: backend, timeouts, the store, GPU check.

Policy (which backend, how long to wait, which store) is in small pure functions; :func:`join`
strings them together. ddpkit makes the group's store itself and hands it to
``init_process_group(store=...)``, so that it decides where the store listens and bounds every
wait of joining (the store's placement and the bounded connect are in
:mod:`ddpkit.worker.store`):

* a world of one gets an in-process ``HashStore``: nobody else has to meet it, so nothing
  listens on the network for it (torch's ``tcp://``/``env://`` would host an unauthenticated
  ``TCPStore`` on every interface);
* rank 0 hosts a ``TCPStore`` on loopback when the job allows it, else on every interface;
  under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent hosts it and every rank is
  a client, as torch's own ``env://`` would do;
* a client first probes the master (the TCP connect, bounded by the connect timeout), then
  makes torch's client in a thread bounded by what is left of it (at least
  :data:`~ddpkit.worker.store.HANDSHAKE_MIN_S`): a port held by something that accepts and
  never answers ends as a :class:`RendezvousError` naming address, port and launcher, never as
  a wait past the connect and collective timeouts;
* everything after that (gloo's or NCCL's exchange of addresses through the store, their
  connects) waits at most the collective timeout, which is also the store's own timeout.

When the rank record carries a :class:`~ddpkit.cluster.ports.PortSearch` (a SLURM step
without MASTER_PORT), rank 0 hosts on the first candidate it can bind and the others find it
by the job's identity (:mod:`ddpkit.worker.portsearch`).
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]  # public, not in __all__
from torch.distributed.distributed_c10d import Store

from ddpkit.cluster.devices import check_distinct_gpus
from ddpkit.cluster.durations import positive_seconds, seconds_from_env
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.contract import COLLECTIVE_TIMEOUT_VAR, DEFAULT_CONNECT_TIMEOUT_S
from ddpkit.errors import ConfigError, RendezvousError
from ddpkit.worker.portsearch import IDENTITY_KEY, find_store, host_store
from ddpkit.worker.store import (
    CONNECT_TIMEOUT_VAR,
    HANDSHAKE_MIN_S,
    connect_client,
    host_tcp_store,
    is_taken,
    probe_master,
    store_endpoint,
)

__all__ = [
    "AGENT_STORE_VAR",
    "COLLECTIVE_TIMEOUT_VAR",
    "CONNECT_TIMEOUT_VAR",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "IDENTITY_KEY",
    "check_exclusive_gpus",
    "collective_timeout",
    "connect_timeout",
    "destroy",
    "find_store",
    "host_store",
    "join",
    "probe_master",
    "resolve_backend",
    "store_timeout",
    "uses_agent_store",
]

# Set by torchrun's agent for its workers: "True" when the agent hosts the store they share.
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"

# torch's documented default timeout of an NCCL group (a CPU-only build leaves the constant None).
_NCCL_DEFAULT_TIMEOUT = timedelta(minutes=10)


def connect_timeout(env: Mapping[str, str], explicit_s: float | None) -> float:
    """Seconds to wait for the master: the caller's ``connect_timeout_s`` when given, else
    ``DDPKIT_CONNECT_TIMEOUT`` from ``env`` (so operators can lengthen it without editing the
    script), else 60 s."""
    if explicit_s is not None:
        return positive_seconds(explicit_s, "connect_timeout_s")
    value = seconds_from_env(env, CONNECT_TIMEOUT_VAR, example="120")
    return DEFAULT_CONNECT_TIMEOUT_S if value is None else value


def collective_timeout(env: Mapping[str, str], explicit_s: float | None) -> float | None:
    """The collective timeout for ``init_process_group``: the caller's ``timeout_s`` when
    given, else ``DDPKIT_COLLECTIVE_TIMEOUT`` from ``env``, else None (torch's default, 10 min
    for NCCL, 30 min otherwise). It bounds a rank that hangs while alive; ddpkit does not lower
    it by default, since ranks legitimately wait at a barrier while rank 0 prepares data."""
    if explicit_s is not None:
        return positive_seconds(explicit_s, "timeout_s")
    return seconds_from_env(env, COLLECTIVE_TIMEOUT_VAR, example="1800")


def resolve_backend(backend: str, device_type: str) -> str:
    """``"auto"`` → ``nccl`` on CUDA, ``gloo`` otherwise; any other string passes through."""
    name = backend.strip()
    if not name:
        raise ConfigError(f"backend={backend!r} is empty", hint="use 'auto', 'gloo' or 'nccl'")
    if name == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if name == "nccl" and device_type != "cuda":
        raise ConfigError(
            f"backend='nccl' needs a CUDA device but this rank's device is {device_type!r}",
            hint="use backend='auto' or 'gloo' without GPUs, or pass a CUDA device=",
        )
    return name


def store_timeout(backend: str, timeout_s: float | None) -> timedelta:
    """The store's own timeout: the collective timeout, else torch's default for ``backend``
    (what ``init_process_group`` gives the store it makes for ``env://``/``tcp://``)."""
    if timeout_s is not None:
        return timedelta(seconds=timeout_s)
    if "nccl" in backend:
        return dist.constants.default_pg_nccl_timeout or _NCCL_DEFAULT_TIMEOUT
    return dist.constants.default_pg_timeout


def uses_agent_store(info: RankInfo, env: Mapping[str, str]) -> bool:
    """True when torchrun's agent hosts the store and rank 0 is one of its clients."""
    return info.launcher == "torchrun" and env.get(AGENT_STORE_VAR) == str(True)


def join(
    info: RankInfo,
    *,
    backend: str,
    device: torch.device,
    env: Mapping[str, str],
    timeout_s: float | None,
    connect_timeout_s: float,
) -> RankInfo:
    """Make or reach the store (see the module docstring), then ``init_process_group``.

    Returns ``info`` with the address and port of the store actually used (another port than
    ``master_port`` only after a port search; 127.0.0.1 when every rank is on one node).
    """
    if timeout_s is not None:
        positive_seconds(timeout_s, "timeout_s")
    store, info = _store(info, env, connect_timeout_s, store_timeout(backend, timeout_s))
    try:
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
            # Binds NCCL eagerly to this rank's GPU; other backends do not need it.
            device_id=device if "nccl" in backend and device.type == "cuda" else None,
        )
    except dist.DistError as exc:  # the store's timeout, a peer unreachable: torch's words
        raise _not_formed(info, exc, timeout_s) from exc
    return info


def _not_formed(info: RankInfo, exc: Exception, timeout_s: float | None) -> RendezvousError:
    bound = "torch's default" if timeout_s is None else f"{timeout_s:g} s"
    return RendezvousError(
        f"rank {info.rank} (launcher {info.launcher}) reached the store at {info.master_addr}:"
        f"{info.master_port} but the group did not form (collective timeout {bound}): "
        f"{' '.join(str(exc).split())[:300]}",
        hint=(
            "a rank has not started, crashed or is stuck (check every rank's log); another "
            "job's store on that port (two jobs given one MASTER_PORT?); a peer's address "
            "unreachable from here (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME pick the "
            f"interface). If ranks only start slowly, raise {COLLECTIVE_TIMEOUT_VAR}"
        ),
    )


def _store(
    info: RankInfo, env: Mapping[str, str], connect_timeout_s: float, timeout: timedelta
) -> tuple[Store, RankInfo]:
    if info.world_size == 1:
        return HashStore(), info  # nobody else to meet: nothing listens for it
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
    if info.rank == 0 and not uses_agent_store(info, env):
        return _host(info, bind, timeout, env), info
    return _connect(info, connect_timeout_s, timeout), info


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


def _connect(info: RankInfo, connect_timeout_s: float, timeout: timedelta) -> Store:
    """A client of the store: the probe, then torch's handshake, each bounded."""
    deadline = time.monotonic() + connect_timeout_s
    probe_master(info, connect_timeout_s)
    return connect_client(
        info.master_addr,
        info.master_port,
        world_size=info.world_size,
        timeout=timeout,
        bound_s=max(HANDSHAKE_MIN_S, deadline - time.monotonic()),
        who=f"rank {info.rank} (launcher {info.launcher})",
    )


def check_exclusive_gpus(devices: Sequence[torch.device]) -> None:
    """After joining on CUDA: all-gather (hostname, uuids of ``devices``, the GPUs this rank
    uses) and reject a GPU used by two ranks.

    Needs CUDA and a formed group; the pure check is :func:`check_distinct_gpus`.
    """
    uuids = [str(torch.cuda.get_device_properties(device).uuid) for device in devices]
    identities: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(identities, (socket.gethostname(), uuids))
    check_distinct_gpus([cast(tuple[str, list[str]], identity) for identity in identities])


def destroy() -> None:
    """Destroy the default process group if one exists."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
