"""gloo's and NCCL's interface on a multi-node ``ddpkit run``: the one of the route to the
rendezvous host, per node, unless the user set the variable
(:func:`ddpkit.launch.local.ifname_env`)."""

from __future__ import annotations

import os

import pytest

from ddpkit.cli.run import config_from_argv
from ddpkit.cluster.rendezvous.ifname import IFNAME_VARS
from ddpkit.cluster.rendezvous.interfaces import (
    Interface,
    interfaces,
    is_this_host,
    route_interface,
)
from ddpkit.launch.local import build_launch_config, ifname_env
from tests.support.needs import missing

IB0 = Interface("ib0", True, False, ("10.1.0.5",))
LO = Interface("lo", True, True, ("127.0.0.1",))
WORKER = "tests/scripts/env_worker.py"


def not_here(host: str) -> bool:
    return False  # the rendezvous host is another node


def routes_to(interface: Interface | None, asked: list[str] | None = None):  # type: ignore[no-untyped-def]
    def route(host: str) -> Interface | None:
        if asked is not None:
            asked.append(host)
        return interface

    return route


def test_each_unset_variable_names_the_interface_of_the_route_to_the_rendezvous() -> None:
    asked: list[str] = []
    chosen = ifname_env({}, 2, "n1-ib:29400", routes_to(IB0, asked), not_here)
    assert chosen == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert asked == ["n1-ib"]
    assert ifname_env({}, 4, "[fd00::1]:29400", routes_to(IB0, asked), not_here) == chosen
    assert asked[-1] == "fd00::1"


def test_a_variable_the_user_set_is_kept_even_empty() -> None:
    users = {"GLOO_SOCKET_IFNAME": "eth1"}
    chosen = ifname_env(users, 2, "n1:29400", routes_to(IB0), not_here)
    assert chosen == {"NCCL_SOCKET_IFNAME": "ib0"}
    both = dict.fromkeys(IFNAME_VARS, "")
    assert ifname_env(both, 2, "n1:29400", routes_to(IB0), not_here) == {}


@pytest.mark.parametrize(
    ("nodes", "endpoint", "route"),
    [
        (1, "n1:29400", IB0),  # one node: nobody else has to reach it
        (2, "127.0.0.1:29400", IB0),  # every agent on this host
        (2, "localhost:29400", IB0),
        (2, "n1:29400", LO),  # the host name resolves to 127.0.1.1: NCCL's default is better
        (2, "n1:29400", None),  # no route, or a name that does not resolve
        (2, "", IB0),
    ],
)
def test_left_to_the_backends(nodes: int, endpoint: str, route: Interface | None) -> None:
    assert ifname_env({}, nodes, endpoint, routes_to(route), not_here) == {}


def test_the_route_to_this_hosts_own_address_leaves_through_its_interface() -> None:
    found = interfaces()
    mine = [i for i in found if i.up and not i.loopback and any("." in a for a in i.addresses)]
    if not mine:
        missing("no network interface with an IPv4 address here")
    address = next(a for a in mine[0].addresses if "." in a)
    assert route_interface(address, found) == mine[0]
    assert route_interface("127.0.0.1", found) == next(i for i in found if i.loopback)
    assert route_interface("no-such-host.invalid", found) is None


def test_ddpkit_run_on_several_nodes_hands_the_workers_the_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = interfaces()
    mine = [i for i in found if i.up and not i.loopback and any("." in a for a in i.addresses)]
    if not mine:
        missing("no network interface with an IPv4 address here")
    address = next(a for a in mine[0].addresses if "." in a)
    *net, last = address.split(".")
    neighbour = ".".join([*net, str(int(last) % 250 + 1)])  # another host, on that network
    routed = route_interface(neighbour, found)
    if routed is None or routed.loopback or is_this_host(neighbour, found):
        missing(f"no route to {neighbour}, another host on {mine[0].name}'s network")
    for name in [*IFNAME_VARS, "SLURM_JOB_NODELIST"]:
        monkeypatch.delenv(name, raising=False)
    argv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", f"{neighbour}:29400", WORKER]
    plan = build_launch_config(config_from_argv(argv, dict(os.environ)))
    assert {key: plan.worker_env.get(key) for key in IFNAME_VARS} == dict.fromkeys(
        IFNAME_VARS, routed.name
    )
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=users0")
    plan = build_launch_config(config_from_argv(argv, dict(os.environ)))
    assert "NCCL_SOCKET_IFNAME" not in plan.worker_env
    assert plan.worker_env["GLOO_SOCKET_IFNAME"] == routed.name
    one = ["--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{address}:1"]
    plan = build_launch_config(config_from_argv([*one, WORKER], dict(os.environ)))
    assert "GLOO_SOCKET_IFNAME" not in plan.worker_env  # one node: the backends' own choice


def test_the_rendezvous_host_takes_the_route_to_another_node_of_the_job() -> None:
    asked: list[str] = []
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n1"}
    local = lambda host: host == "n1"  # noqa: E731
    chosen = ifname_env(env, 3, "n1:29400", routes_to(IB0, asked), local)
    assert chosen == dict.fromkeys(IFNAME_VARS, "ib0") and asked == ["n2"]
    templated = env | {"DDPKIT_HOST_TEMPLATE": "{host}-ib"}
    ifname_env(templated, 3, "n1-ib:29400", routes_to(IB0, asked), lambda h: h == "n1-ib")
    assert asked[-1] == "n2-ib"  # the name the other nodes are reached by, as n1-ib was
    # no other node known (outside SLURM), or none readable: the backends' own choice
    assert ifname_env({}, 2, "n1:29400", routes_to(IB0), local) == {}
    bad = {"SLURM_JOB_NODELIST": "n[1-", "SLURMD_NODENAME": "n1"}
    assert ifname_env(bad, 2, "n1:29400", routes_to(IB0), local) == {}
    assert is_this_host("127.0.0.1") and not is_this_host("no-such-host.invalid")
