"""The network interfaces a multi-node ``ddpkit run`` gives its workers for gloo and NCCL.

Each node's agent gives its workers ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` naming
the interface of its route to the rendezvous host, unless the user set either: the rule and
why are :mod:`ddpkit.cluster.rendezvous.ifname`'s. One node leaves both alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ddpkit.cluster.rendezvous.ifname import IFNAME_VARS, job_interface, unset_vars
from ddpkit.cluster.rendezvous.interfaces import Interface, is_this_host, route_interface

__all__ = ["IFNAME_VARS", "ifname_env", "tell"]

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
    unset = unset_vars(env)
    if max_nodes <= 1 or not unset or not rdzv_endpoint:
        return {}
    host, _ = parse_rendezvous_endpoint(rdzv_endpoint, _ANY_PORT)
    name = job_interface(host, env, route, this_host)
    return {} if name is None else dict.fromkeys(unset, name)


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
