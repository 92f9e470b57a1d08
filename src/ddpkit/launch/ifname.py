"""The network interface a multi-node ``ddpkit run``'s workers use for gloo and NCCL.

Left to themselves, gloo listens on the address the host name resolves to and NCCL's sockets
on the first interface that is up (InfiniBand first). On a node with several interfaces whose
host name resolves to one the other nodes cannot reach, the group then hangs or fails
(pytorch#111424, accelerate#1489). The interface that reaches the rendezvous host is one the
other nodes reach this node on as well, so each node's agent gives its workers
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` naming it, unless the user set either
(their choice, kept as is). The node hosting the rendezvous takes the route to another node
of the job instead (its route to itself says nothing). One node, or a route over loopback (a
host name that resolves to 127.0.1.1, or every "node" on one host), leaves both alone: the
backends' own choice is no worse there, and loopback would be wrong for NCCL's other nodes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ddpkit.cluster.environments.slurm import apply_host_template
from ddpkit.cluster.nodelist import expand_nodelist
from ddpkit.cluster.rendezvous.interfaces import (
    Interface,
    is_loopback,
    is_this_host,
    route_interface,
)
from ddpkit.errors import ConfigError

__all__ = ["IFNAME_VARS", "ifname_env", "tell"]

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_ANY_PORT = 0  # parse_rendezvous_endpoint's default port; only the host is used


def ifname_env(
    env: Mapping[str, str],
    max_nodes: int,
    rdzv_endpoint: str,
    route: Callable[[str], Interface | None] = route_interface,
    this_host: Callable[[str], bool] = is_this_host,
) -> dict[str, str]:
    """The variables (of :data:`IFNAME_VARS`) the workers get: each one the user has not set,
    naming the interface of the route to the rendezvous host (``route``), on several nodes.
    On the node that hosts the rendezvous, the route to itself says nothing, so the route to
    another node of the SLURM job is taken (through ``host_template``, as the rendezvous host's
    name was); none known leaves both to the backends."""
    unset = [name for name in IFNAME_VARS if name not in env]
    if max_nodes <= 1 or not unset or not rdzv_endpoint:
        return {}
    host, _ = parse_rendezvous_endpoint(rdzv_endpoint, _ANY_PORT)
    if not host or is_loopback(host):
        return {}
    if this_host(host):
        peers = _peers(env)
        if not peers:
            return {}
        host = peers[0]
    interface = route(host)
    if interface is None or interface.loopback:
        return {}
    return dict.fromkeys(unset, interface.name)


def _peers(env: Mapping[str, str]) -> list[str]:
    """The other nodes of this SLURM job, through ``host_template`` ([] outside SLURM)."""
    nodelist, me = env.get("SLURM_JOB_NODELIST", ""), env.get("SLURMD_NODENAME", "")
    try:
        names = expand_nodelist(nodelist, source="SLURM_JOB_NODELIST") if nodelist else []
        return [apply_host_template(env, name) for name in names if name != me]
    except ConfigError:  # a list or template ddpkit cannot read: no peer known
        return []


def tell(chosen: Mapping[str, str]) -> None:
    """One line on the agent's stderr naming what the workers got and why."""
    if not chosen:
        return
    names = " ".join(f"{key}={value}" for key, value in chosen.items())
    print(
        f"ddpkit run: workers get {names} (the interface of this node's route to the others)",
        file=sys.stderr,
        flush=True,
    )
