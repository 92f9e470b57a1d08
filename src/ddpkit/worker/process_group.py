"""Joining the torch.distributed process group: backend, timeouts, GPU check.

Policy (which backend, how long to wait) is in small pure functions; :func:`join` strings them
together. ddpkit makes the group's store itself (:mod:`ddpkit.worker.rendezvous.group`, every
wait bounded) and hands it to ``init_process_group(store=...)``; what follows waits at most the
collective timeout, which is also the store's.

Where every rank is on this host, gloo's own listener is kept on loopback too, whatever
``GLOO_SOCKET_IFNAME`` or the host name says; over several nodes, gloo and NCCL use the
interface of the route to the rendezvous host unless the user named one
(:func:`_interface_vars`).
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from ddpkit.cluster.devices import check_distinct_gpus
from ddpkit.cluster.durations import positive_seconds, scaled_bound, seconds_from_env
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.cluster.rendezvous.ifname import job_interface, unset_vars
from ddpkit.contract import (
    COLLECTIVE_TIMEOUT_VAR,
    CONNECT_TIMEOUT_VAR,
    DEFAULT_CONNECT_TIMEOUT_S,
)
from ddpkit.errors import ConfigError, RendezvousError
from ddpkit.worker.rendezvous.group import make_store
from ddpkit.worker.rendezvous.store import loopback_address

__all__ = [
    "COLLECTIVE_TIMEOUT_VAR",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "check_exclusive_gpus",
    "collective_timeout",
    "connect_timeout",
    "destroy",
    "join",
    "resolve_backend",
    "store_timeout",
]

# torch's documented default timeout of an NCCL group (a CPU-only build leaves the constant None).
_NCCL_DEFAULT_TIMEOUT = timedelta(minutes=10)
# Read by gloo when it makes its device (in init_process_group): the interface it listens on.
_GLOO_IFNAME_VAR = "GLOO_SOCKET_IFNAME"


def connect_timeout(env: Mapping[str, str], explicit_s: float | None, world_size: int = 1) -> float:
    """Seconds to wait for the master: the caller's ``connect_timeout_s`` when given, else
    ``DDPKIT_CONNECT_TIMEOUT`` from ``env`` (so operators can lengthen it without editing the
    script), else 60 s plus 10 ms per rank of ``world_size`` after the first (see
    :data:`~ddpkit.contract.BOUND_PER_RANK_S`): ranks reach one store one by one."""
    if explicit_s is not None:
        return positive_seconds(explicit_s, "connect_timeout_s")
    value = seconds_from_env(env, CONNECT_TIMEOUT_VAR, example="120")
    return scaled_bound(DEFAULT_CONNECT_TIMEOUT_S, world_size) if value is None else value


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


def join(
    info: RankInfo,
    *,
    backend: str,
    device: torch.device,
    env: Mapping[str, str],
    timeout_s: float | None,
    connect_timeout_s: float,
) -> RankInfo:
    """Make or reach the store (:func:`~ddpkit.worker.rendezvous.group.make_store`), then
    ``init_process_group``.

    Returns ``info`` with the address and port of the store actually used (another port than
    ``master_port`` only after a port search; 127.0.0.1 when every rank is on one node). A gloo
    group of several ranks is formed on every rank by then (:func:`_formed_everywhere`).
    ``timeout_s`` is :func:`collective_timeout`'s, checked there.
    """
    _RETIRED.clear()  # a group destroyed before: its store may listen on the port wanted now
    store, info = make_store(info, env, connect_timeout_s, store_timeout(backend, timeout_s))
    one_host = info.world_size == 1 or loopback_address(info.master_addr) is not None
    try:
        with _interface_vars(info, env, backend, one_host):
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
    if backend == "gloo" and info.world_size > 1:
        try:
            _formed_everywhere()
        except RuntimeError as exc:  # a peer gone before it met the others: gloo's words
            destroy()  # no half-made group stays behind the error
            raise _not_formed(info, exc, timeout_s) from exc
    return info


def _formed_everywhere() -> None:
    """Return once every rank's gloo group is formed: a barrier, its first collective, bounded
    by the collective timeout. gloo's ``init_process_group`` returns on the rank that opened a
    pair's connection before the accepting rank is done: one that then left would fail the
    slower one's start with "Connection closed by peer"."""
    dist.barrier()


def _interface_vars(
    info: RankInfo, env: Mapping[str, str], backend: str, one_host: bool
) -> AbstractContextManager[None]:
    """For the one ``init_process_group`` call: a gloo group whose ranks are all on this host
    listens on loopback (another interface would only expose it); a group over several nodes
    uses the interface of this node's route to the rendezvous host, for gloo and NCCL
    (:mod:`ddpkit.cluster.rendezvous.ifname`: under ``launch: srun`` no agent has set them),
    each variable only where the user has not set it."""
    if one_host:
        if "gloo" not in backend:
            return nullcontext()
        names = (
            {name for _, name in socket.if_nameindex()}
            if hasattr(socket, "if_nameindex")
            else set()
        )
        loopback = next((name for name in ("lo", "lo0") if name in names), None)
        return _environ({_GLOO_IFNAME_VAR: loopback} if loopback else {})
    unset = unset_vars(os.environ)
    if info.num_nodes <= 1 or not unset:
        return nullcontext()
    name = job_interface(info.master_addr, env)
    return _environ({} if name is None else dict.fromkeys(unset, name))


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` (the backends read it themselves) for one call, before
    ddpkit starts any thread; what was there is put back."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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


def check_exclusive_gpus(devices: Sequence[torch.device]) -> None:
    """After joining on CUDA: all-gather (hostname, uuids of ``devices``, the GPUs this rank
    uses) and reject a GPU used by two ranks.

    Needs CUDA and a formed group; the pure check is :func:`check_distinct_gpus`.
    """
    uuids = [str(torch.cuda.get_device_properties(device).uuid) for device in devices]
    identities: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(identities, (socket.gethostname(), uuids))
    check_distinct_gpus([cast(tuple[str, list[str]], identity) for identity in identities])


# The Python handle of the last gloo group destroy() destroyed while something still held it:
# one at most, let go at the next destroy() or join() (see destroy()).
_RETIRED: list[object] = []


def destroy() -> None:
    """Destroy the default process group if one exists.

    When a Python object still refers to a gloo group's handle once it is destroyed (a DDP
    model does, through its ``process_group``), ddpkit keeps the handle until its next
    ``destroy()`` or ``join()`` (``init()``) or the end of the process, so that the group's
    C++ object is freed from the handle's destructor, which releases the GIL. Without it, the
    DDP model freed right after (``requeue_and_exit()``'s ``SystemExit`` unwinding the user's
    frames, or a ``del model`` after ``shutdown()``) holds the group's last reference in its
    Reducer, whose destructor joins gloo's threads with the GIL held while one of them waits
    for the GIL to free the last collective's tensors: a deadlock (torch #56297; plain torch's
    ``destroy_process_group()`` then ``del model`` hangs the same way). The cost: that group's
    gloo threads and sockets (rank 0's store listener too), idle, live until then, as they
    would under plain torch for as long as the model lives. Nothing refers to it: freed now.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = dist.group.WORLD
    gloo = "gloo" in str(dist.get_backend(group))
    dist.destroy_process_group()
    _RETIRED.clear()  # the previous one's threads are long idle: freeing it cannot deadlock
    if gloo and gc.get_referrers(group):  # a model's, the user's (this running frame is none)
        _RETIRED.append(group)
