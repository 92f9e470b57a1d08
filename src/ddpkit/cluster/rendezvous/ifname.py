"""The network interface a multi-node job's ranks on this node use for gloo and NCCL.

Left to themselves, gloo listens on the address the host name resolves to and NCCL's sockets
on the first interface that is up (InfiniBand first). On a node with several interfaces whose
host name resolves to one the other nodes cannot reach, the group then hangs or fails
(pytorch#111424, accelerate#1489). The interface that reaches the rendezvous host is one the
other nodes reach this node on as well: ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` name
it, unless the user set either (their choice, kept as is). The node hosting the rendezvous
takes the route to another node of the job instead (its route to itself says nothing). A route
over loopback (a host name that resolves to 127.0.1.1, or every "node" on one host) names
nothing: the backends' own choice is no worse there, and loopback would be wrong for NCCL's
other nodes. ``ddpkit run`` gives its workers the variables
(:func:`ddpkit.launch.local.ifname_env`); under ``launch: srun``, ``ddpkit.init`` sets them for
its one ``init_process_group`` call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ddpkit.cluster.environments.slurm import apply_host_template
from ddpkit.cluster.nodelist import expand_nodelist
from ddpkit.cluster.rendezvous.interfaces import (
    Interface,
    is_loopback,
    is_this_host,
    route_interface,
)
from ddpkit.errors import ConfigError

__all__ = ["IFNAME_VARS", "job_interface", "unset_vars"]

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def unset_vars(env: Mapping[str, str]) -> list[str]:
    """The variables of :data:`IFNAME_VARS` the user has not set in ``env``."""
    return [name for name in IFNAME_VARS if name not in env]


def job_interface(
    host: str,
    env: Mapping[str, str],
    route: Callable[[str], Interface | None] = route_interface,
    this_host: Callable[[str], bool] = is_this_host,
) -> str | None:
    """The name of the interface of this node's route to the rendezvous ``host``; on that host
    itself, of the route to another node of the SLURM job (through ``host_template``, as the
    rendezvous host's name was). None where no route is known or it is loopback."""
    if not host or is_loopback(host):
        return None
    if this_host(host):
        peers = _peers(env)
        if not peers:
            return None
        host = peers[0]
    interface = route(host)
    if interface is None or interface.loopback:
        return None
    return interface.name


def _peers(env: Mapping[str, str]) -> list[str]:
    """The other nodes of this SLURM job, through ``host_template`` ([] outside SLURM)."""
    nodelist, me = env.get("SLURM_JOB_NODELIST", ""), env.get("SLURMD_NODENAME", "")
    try:
        names = expand_nodelist(nodelist, source="SLURM_JOB_NODELIST") if nodelist else []
        return [apply_host_template(env, name) for name in names if name != me]
    except ConfigError:  # a list or template ddpkit cannot read: no peer known
        return []
