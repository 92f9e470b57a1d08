"""Joining the torch.distributed process group: backend, rendezvous URL, master probe, GPU check.

The only module of :mod:`ddpkit.cluster` that imports torch. Policy (which backend, which URL,
how long to wait) is in small pure functions; :func:`join` strings them together.

Before a rank other than 0 joins, :func:`probe_master` checks that rank 0's store accepts TCP
connections, retrying until a deadline, so a missing or crashed rank 0 becomes a
:class:`RendezvousError` naming the address instead of a long silent wait inside torch
(pytorch#118369, #116974). The probe connects and closes normally (FIN): torch's TCPStore,
libuv or classic, logs nothing for that even at ``TORCH_CPP_LOG_LEVEL=INFO``, whereas an
abortive close (RST) makes the libuv store print a warning.

When the rank record carries a :class:`~ddpkit.cluster.ports.PortSearch` (a SLURM step
without MASTER_PORT), a taken port does not end the job: rank 0 hosts the store on the first
candidate it can bind and publishes the search's identity under :data:`IDENTITY_KEY`; the
other ranks try the candidates in order and join the first store that answers with that
identity, skipping a port held by another job's store, by a stale store, or by a listener
that is not a store at all (bounded: torch's store client would wait forever for a reply
such a listener never sends).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore
from torch.distributed.distributed_c10d import Store

from ddpkit.cluster.devices import check_distinct_gpus
from ddpkit.cluster.durations import positive_seconds, seconds_from_env
from ddpkit.cluster.ports import PortSearch
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.errors import ConfigError, RendezvousError

__all__ = [
    "COLLECTIVE_TIMEOUT_VAR",
    "CONNECT_TIMEOUT_VAR",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "IDENTITY_KEY",
    "check_exclusive_gpus",
    "collective_timeout",
    "connect_timeout",
    "destroy",
    "find_store",
    "format_host",
    "host_store",
    "init_method",
    "join",
    "probe_master",
    "resolve_backend",
]

CONNECT_TIMEOUT_VAR = "DDPKIT_CONNECT_TIMEOUT"
COLLECTIVE_TIMEOUT_VAR = "DDPKIT_COLLECTIVE_TIMEOUT"
# What torch's env:// handler reads from os.environ.
_ENV_METHOD_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


DEFAULT_CONNECT_TIMEOUT_S = 60.0
# Where rank 0 publishes the job's identity in its store (PortSearch).
IDENTITY_KEY = "ddpkit/job"
# How long one candidate may take to prove it is this job's store before it is skipped for now.
_IDENTITY_BOUND_S = 2.0


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


def format_host(addr: str) -> str:
    """``addr`` as it goes into a URL: IPv6 literals get brackets."""
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def init_method(info: RankInfo, env: Mapping[str, str]) -> str:
    """``env://`` for torchrun workers, ``tcp://host:port`` otherwise.

    env:// reads ``os.environ``, so it is used only when ``os.environ`` agrees with the mapping
    detection read (always true for ``env=None``); a caller-supplied mapping gets tcp:// with
    the same values. Both go through torch's store factory, which connects to torchrun's agent
    store when ``TORCHELASTIC_USE_AGENT_STORE`` is set instead of hosting one on rank 0.
    """
    if info.launcher == "torchrun" and all(
        env.get(name) is not None and os.environ.get(name) == env.get(name)
        for name in _ENV_METHOD_VARS
    ):
        return "env://"
    return f"tcp://{format_host(info.master_addr)}:{info.master_port}"


def _try_connect(addr: str, port: int, timeout_s: float) -> OSError | None:
    try:
        # Leaving the block closes normally (FIN); see the module docstring on log noise.
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
    """Wait until ``info.master_addr:master_port`` accepts a TCP connection, or raise."""
    deadline = clock() + timeout_s
    delay_s = 0.1
    while True:
        error = _try_connect(
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


def join(
    info: RankInfo,
    *,
    backend: str,
    device: torch.device,
    method: str,
    timeout_s: float | None,
    connect_timeout_s: float,
) -> RankInfo:
    """Probe the master (ranks != 0), then ``init_process_group`` with explicit rank/world.

    Returns ``info`` with the port actually used (another one than ``master_port`` only after
    a port search; see the module docstring).
    """
    if timeout_s is not None:
        positive_seconds(timeout_s, "timeout_s")
    store: Store | None = None
    if info.port_search is not None:
        store_timeout = (
            dist.constants.default_pg_timeout
            if timeout_s is None
            else (timedelta(seconds=timeout_s))
        )
        store, port = _search_store(info, info.port_search, connect_timeout_s, store_timeout)
        info = dataclasses.replace(info, master_port=port)
    elif info.rank != 0 and info.world_size > 1:
        probe_master(info, connect_timeout_s)
    try:
        dist.init_process_group(
            backend=backend,
            init_method=None if store is not None else method,
            store=store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
            # Binds NCCL eagerly to this rank's GPU; other backends do not need it.
            device_id=device if "nccl" in backend and device.type == "cuda" else None,
        )
    except dist.DistNetworkError as exc:
        raise RendezvousError(
            f"rank {info.rank} could not set up the rendezvous store at "
            f"{info.master_addr}:{info.master_port} (launcher {info.launcher}): {exc}",
            hint=(
                f"EADDRINUSE means port {info.master_port} is taken (another job on this node?): "
                "set MASTER_PORT to a free port, or let ddpkit derive one per job"
            ),
        ) from exc
    return info


def _search_store(
    info: RankInfo, search: PortSearch, connect_timeout_s: float, timeout: timedelta
) -> tuple[Store, int]:
    addr, world = info.master_addr, info.world_size
    if info.rank == 0:
        return host_store(addr, search, timeout, world_size=world)
    return find_store(addr, search, connect_timeout_s, timeout, who=f"rank {info.rank}")


def host_store(
    addr: str,
    search: PortSearch,
    timeout: timedelta,
    *,
    world_size: int | None = None,
    multi_tenant: bool = False,
    share: bool = False,
) -> tuple[TCPStore, int]:
    """Host the store on the first candidate port that binds; publish the search's identity.

    ``multi_tenant``: a store torch later opens on the same port in this process (the c10d
    rendezvous of ``ddpkit run``) shares this one's server instead of binding again.
    ``share``: a taken port whose store answers with the identity (another process of the
    same job on this node got there first) is joined as a client instead of skipped.
    """
    taken: list[str] = []
    for port in search.ports:
        try:
            store = TCPStore(
                addr,
                port,
                world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                multi_tenant=multi_tenant,
            )
        except dist.DistNetworkError as exc:
            if "EADDRINUSE" not in str(exc):
                raise _unhostable(addr, search, f"port {port}: {exc}") from exc
            if share:
                client, answer, _ = _ask_identity(addr, port, _IDENTITY_BOUND_S)
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
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[TCPStore, int]:
    """The first candidate on ``addr`` whose store answers with the search's identity.

    Passes over the candidates until ``timeout_s`` runs out (the host may start later): a port
    nobody listens on, another job's store, or a silent listener is skipped for this pass. A
    silent listener leaves a client thread blocked on it; the port is not retried while that
    thread waits, so each port costs at most one such thread. ``who`` names the caller in the
    error.
    """
    deadline = clock() + timeout_s
    seen: dict[int, str] = {}
    silent: dict[int, threading.Thread] = {}
    delay_s = 0.1
    while True:
        for port in search.ports:
            if port in silent and silent[port].is_alive():
                continue
            remaining = deadline - clock()
            error = _try_connect(addr, port, min(5.0, max(0.1, remaining)))
            if error is not None:
                refused = isinstance(error, ConnectionRefusedError)
                seen[port] = "nothing listening" if refused else str(error)
                continue
            bound_s = min(_IDENTITY_BOUND_S, max(0.1, remaining))
            store, answer, thread = _ask_identity(addr, port, bound_s)
            if store is not None and answer == search.identity:
                store.set_timeout(timeout)
                return store, port
            if thread is not None:
                silent[port] = thread
            seen[port] = f"the store of {answer}" if store is not None else answer
        remaining = deadline - clock()
        if remaining <= 0:
            raise _not_found(who, addr, search, timeout_s, seen)
        sleep(min(delay_s, remaining))
        delay_s = min(2 * delay_s, 1.0)


def _ask_identity(
    addr: str, port: int, bound_s: float
) -> tuple[TCPStore | None, str, threading.Thread | None]:
    """(client, the identity its store holds, None), or (None, why not, the thread if it hangs).

    The client is made in a daemon thread: against a listener that accepts but never replies,
    torch's client blocks in its handshake regardless of its timeout.
    """
    result: list[TCPStore | str] = []

    def ask() -> None:
        try:
            client = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=bound_s))
            client.wait([IDENTITY_KEY], timedelta(seconds=bound_s))
            result.append(client)
        except Exception as exc:  # any failure means: not (yet) this job's store
            result.append(f"a store without ddpkit's identity ({type(exc).__name__})")

    thread = threading.Thread(target=ask, name=f"ddpkit-store-probe-{port}", daemon=True)
    thread.start()
    thread.join(2 * bound_s)
    if not result:
        return None, "a listener that is not a store (no answer)", thread
    found = result[0]
    if isinstance(found, str):
        return None, found, None
    return found, found.get(IDENTITY_KEY).decode(errors="replace"), None


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
