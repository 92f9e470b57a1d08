"""The c10d rendezvous port of ``ddpkit run``: searched in a SLURM job, loopback-only stores.

torch's agent on the first node binds the c10d port, and when something else holds it
becomes a client of that listener instead: it waits forever on one that is no store, or runs
in another job's store. So inside a SLURM step, for the port derived from the job id only
(``rdzv_port: auto``), the hosting node hosts the store itself on the first candidate it can
bind (:func:`ddpkit.cluster.rendezvous.ports.step_search`), multi-tenant so the agent shares
its server, and the other nodes take the first candidate whose store answers with the job's
identity (:mod:`ddpkit.worker.rendezvous.portsearch`); every agent is pointed at that port.

Outside that search, a loopback endpoint (``--standalone`` is ``localhost:0``) and the store
the workers of a one-node run of one round share (:func:`shared_store_bind`) are hosted on
loopback only: torch's agent would listen on every interface.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from torch.distributed import DistNetworkError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from ddpkit.cluster.environments.slurm import in_slurm_step
from ddpkit.cluster.rendezvous.endpoint import RDZV_STEP
from ddpkit.cluster.rendezvous.ports import PortSearch, port_for_job, step_search
from ddpkit.compat import matches_machine_hostname
from ddpkit.worker.rendezvous.portsearch import find_store, host_store
from ddpkit.worker.rendezvous.store import host_tcp_store, is_taken, loopback_address

__all__ = ["READ_TIMEOUT_S", "claim", "host_shared_store", "shared_store_bind"]

_C10D_DEFAULT_PORT = 29400  # torch's c10d rendezvous default, when the endpoint has no port
_JOIN_TIMEOUT_S = 900.0  # torch's default rdzv join timeout (rdzv_configs["timeout"])
READ_TIMEOUT_S = 60.0  # torch's default c10d store read timeout (rdzv_configs["read_timeout"])
_SHARED_STORE_TIMEOUT_S = 300.0  # torch's TCPStore default, which its shared store keeps


def claim(config: LaunchConfig, env: Mapping[str, str]) -> Any:
    """Search the port (see the module docstring) and point ``config`` at it; the store this node
    hosts (keep it until the agent is done: the agent shares its server), or None."""
    job = env.get("SLURM_JOB_ID")
    if config.rdzv_backend != "c10d" or not job or not in_slurm_step(env):
        return _host_on_loopback(config)
    host, derived = parse_rendezvous_endpoint(config.rdzv_endpoint, _C10D_DEFAULT_PORT)
    if derived != port_for_job(job, RDZV_STEP):
        return _host_on_loopback(config)
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    identity = f"c10d rendezvous {config.run_id} of slurm job {job} restart {restarts}"
    search = step_search(identity, job, RDZV_STEP, env)
    configs = config.rdzv_configs
    read_s = float(configs.get("read_timeout", READ_TIMEOUT_S))
    is_host = configs.get("is_host")
    hosting = matches_machine_hostname(host) if is_host is None else _truthy(is_host)
    if hosting:
        # share: torch lets several agents of one rendezvous run on the host node, the
        # first to bind hosts; the others must join it, not host a second store elsewhere.
        store, port = host_store(
            host, search, timedelta(seconds=read_s), multi_tenant=True, share=True
        )
    else:
        join_s = float(configs.get("timeout", _JOIN_TIMEOUT_S))
        store, port = find_store(host, search, join_s, timedelta(seconds=read_s), who="ddpkit run")
        store = None  # only the answer was needed; the agent opens its own connection
    if port != derived:
        _tell(host, search, port)
    config.rdzv_endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return store


def _host_on_loopback(config: LaunchConfig) -> Any:
    """The store of a loopback endpoint, hosted on loopback only, with ``config`` pointed at
    it; None when this agent hosts none. A taken port is left to torch (which joins it)."""
    if config.rdzv_backend not in ("c10d", "static"):
        return None
    bind, port = _loopback_endpoint(config)
    configs = config.rdzv_configs
    hosting = _truthy(configs.get("is_host", "1")) and str(configs.get("rank", 0)) == "0"
    if bind is None or not hosting:
        return None
    read_s = float(configs.get("read_timeout", READ_TIMEOUT_S))
    try:
        store = _loopback_store(bind, port, read_s)
    except (OSError, DistNetworkError) as exc:
        if is_taken(exc):
            return None
        raise
    config.rdzv_endpoint = f"[{bind}]:{store.port}" if ":" in bind else f"{bind}:{store.port}"
    return store


def shared_store_bind(config: LaunchConfig) -> str | None:
    """The loopback address of a c10d rendezvous of one round on one node, else None: its
    workers share the agent's store, hosted there (:func:`host_shared_store`)."""
    one_round = config.max_restarts == 0 and config.max_nodes == 1
    if config.rdzv_backend != "c10d" or not one_round:
        return None
    if config.local_addr and loopback_address(config.local_addr) is None:
        return None  # the user named a routable address for this node: torch's way
    return _loopback_endpoint(config)[0]


def host_shared_store(bind: str, port: int) -> Any:
    """The store the workers of such a run share, where torch's agent would make it on every
    interface (:func:`ddpkit.compat.rdzv_shared_store_made_by`): on ``bind`` only, with the
    timeout torch gives it."""
    return _loopback_store(bind, port, _SHARED_STORE_TIMEOUT_S)


def _loopback_endpoint(config: LaunchConfig) -> tuple[str | None, int]:
    """(the loopback address the rendezvous endpoint names, or None; its port)."""
    host, port = parse_rendezvous_endpoint(config.rdzv_endpoint, _C10D_DEFAULT_PORT)
    return loopback_address(host), port


def _loopback_store(bind: str, port: int, timeout_s: float) -> Any:
    """A multi-tenant store listening on ``bind`` only (the agent shares its server)."""
    return host_tcp_store(
        bind, port, bind=bind, world_size=None, timeout=timedelta(seconds=timeout_s),
        multi_tenant=True,
    )  # fmt: skip


def _tell(host: str, search: PortSearch, port: int) -> None:
    """One line when the agents meet elsewhere than at the endpoint the job script printed."""
    skipped = ", ".join(str(p) for p in search.ports[: search.ports.index(port)])
    why = f"{skipped} taken" if skipped else "the port SLURM reserved for the step"
    print(f"ddpkit run: c10d rendezvous at {host}:{port} ({why})", file=sys.stderr, flush=True)


def _truthy(value: object) -> bool:
    return str(value).strip().lower() in {"1", "true", "yes", "y", "on"}
