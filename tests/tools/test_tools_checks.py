"""The doctor's checks and the network choices, as tables over plain facts (no I/O)."""

from __future__ import annotations

import math

import pytest

from ddpkit.cluster.limits import open_files_needed
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.cluster.rendezvous.lookup import route_to
from ddpkit.tools import commtest, netinfo
from ddpkit.tools.doctor_checks import (
    RankFacts,
    check_arrivals,
    check_free_space,
    check_gpus,
    check_interface,
    check_launcher_open_files,
    check_layout,
    check_listen_backlog,
    check_master_address,
    check_name_lookup,
    check_open_files,
    check_versions,
    check_visible_devices,
)
from ddpkit.tools.envreport import MASKED, mask, relevant_variables


def info(num_nodes: int = 1, world: int = 2, local: int = 2, addr: str = "n1") -> RankInfo:
    return RankInfo(0, 0, world, local, 0, num_nodes, addr, 29500, "slurm")


def facts(rank: int, node: str = "n1", **kw: object) -> RankFacts:
    base: dict[str, object] = dict(
        rank=rank, local_world_size=2, node=node, torch="2.13.0", nccl=None,
        cuda_visible_devices=None, gpu_uuids=[],
    )  # fmt: skip
    return RankFacts(**(base | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("addr", "resolved", "nodes", "status", "words"),
    [
        ("n1", ["10.0.0.1"], 2, "PASS", "resolves to 10.0.0.1"),
        ("127.0.0.1", ["127.0.0.1"], 1, "PASS", "resolves"),
        ("127.0.0.1", ["127.0.0.1"], 2, "FAIL", "spans 2 nodes but MASTER_ADDR=127.0.0.1"),
        ("vm", ["127.0.1.1"], 2, "FAIL", "is loopback"),
        ("nohost", [], 1, "FAIL", "does not resolve"),
    ],
)
def test_master_address(
    addr: str, resolved: list[str], nodes: int, status: str, words: str
) -> None:
    check = check_master_address(info(num_nodes=nodes, addr=addr), resolved)
    assert (check.status, check.name) == (status, "master address")
    assert words in check.detail
    assert (check.hint is not None) == (status == "FAIL")


def test_loopback_interface_fails_only_on_several_nodes_and_suggests_the_route() -> None:
    lo = netinfo.Choice("lo", "127.0.0.1", "the host name vm resolves to 127.0.0.1")
    assert check_interface("gloo", lo, 1, "eth0").status == "PASS"
    check = check_interface("gloo", lo, 2, "eth0")
    assert check.status == "FAIL" and "loopback on a 2-node job" in check.detail
    assert check.hint is not None and "GLOO_SOCKET_IFNAME=eth0" in check.hint
    missing = netinfo.Choice(None, None, "GLOO_SOCKET_IFNAME=ib9 names no interface here")
    assert check_interface("gloo", missing, 1, None).status == "FAIL"


def test_a_host_name_off_the_route_to_the_master_warns_on_several_nodes() -> None:
    # the host name resolves to the management network's address, the master is reached on ib0
    eth = netinfo.Choice("eth0", "192.168.0.7", "the host name n7 resolves to 192.168.0.7")
    check = check_interface("gloo", eth, 2, "ib0")
    assert check.status == "WARN"
    assert "but the route to MASTER_ADDR leaves through ib0" in check.detail
    assert "other nodes may not reach 192.168.0.7" in check.detail
    assert check.hint is not None and "GLOO_SOCKET_IFNAME=ib0" in check.hint
    nccl = netinfo.Choice("eth0", "192.168.0.7", "NCCL's default: ib* first, not lo/docker*")
    assert check_interface("nccl", nccl, 2, "ib0").status == "WARN"
    assert check_interface("gloo", eth, 1, "ib0").status == "PASS"  # one node: nobody joins
    assert check_interface("gloo", eth, 2, "eth0").status == "PASS"  # the route's interface
    assert check_interface("gloo", eth, 2, None).status == "PASS"  # no route known
    # the user's own variable is theirs to keep, e.g. a data network apart from the store's
    named = netinfo.Choice("eth1", "10.1.0.7", "GLOO_SOCKET_IFNAME=eth1")
    assert check_interface("gloo", named, 2, "ib0").status == "PASS"


def test_arrivals_name_the_missing_ranks() -> None:
    check = check_arrivals(4, [0, 2], 3.0)
    assert check.status == "FAIL"
    assert check.detail == "2 of 4 ranks never showed up within 3 s: 1, 3"
    assert check_arrivals(2, [1, 0], 3.0).status == "PASS"


def test_layout_catches_a_doubled_world_and_a_missing_node() -> None:
    good = [facts(0), facts(1), facts(2, "n2"), facts(3, "n2")]
    assert check_layout(info(num_nodes=2, world=4), good).status == "PASS"
    doubled = [facts(r, local_world_size=2) for r in range(4)]  # 4 ranks on n1, 2 expected
    check = check_layout(info(num_nodes=1, world=4), doubled)
    assert check.status == "FAIL" and "4 ranks on n1 but LOCAL_WORLD_SIZE=2" in check.detail
    one_node = [facts(r) for r in range(2)]
    assert check_layout(info(num_nodes=2, world=2), one_node).status == "FAIL"


def test_versions_must_agree() -> None:
    assert check_versions([facts(0), facts(1)]).status == "PASS"
    check = check_versions([facts(0), facts(1, torch="2.5.0")])
    assert (
        check.status == "FAIL"
        and "torch differs" in check.detail
        and "2.5.0: ranks 1" in (check.detail)
    )
    nccl = check_versions([facts(0, nccl="2.21.5"), facts(1, nccl="2.18.1")])
    assert nccl.status == "FAIL" and "NCCL differs" in nccl.detail


def test_gpus_shared_by_two_ranks_fail_through_the_runtime_check() -> None:
    assert check_gpus([facts(0), facts(1)]).detail == "no GPUs in use (CPU ranks)"
    own = [facts(0, gpu_uuids=["GPU-a"]), facts(1, gpu_uuids=["GPU-b"])]
    assert check_gpus(own).status == "PASS"
    other_node = [facts(0, gpu_uuids=["GPU-a"]), facts(1, "n2", gpu_uuids=["GPU-a"])]
    assert check_gpus(other_node).status == "PASS"
    shared = check_gpus([facts(0, gpu_uuids=["GPU-a"]), facts(1, gpu_uuids=["GPU-a"])])
    assert shared.status == "FAIL" and "ranks 0 and 1 on n1 share GPU GPU-a" in shared.detail


@pytest.mark.parametrize(
    ("lists", "status"),
    [
        ((None, None), "PASS"),
        (("0,1", "0,1"), "PASS"),
        (("0", "1"), "PASS"),  # --gpus-per-task: disjoint
        (("0,1", "1"), "WARN"),
    ],
)
def test_visible_devices_same_or_disjoint(lists: tuple[str | None, ...], status: str) -> None:
    found = [facts(r, cuda_visible_devices=v) for r, v in enumerate(lists)]
    assert check_visible_devices(found).status == status


def test_free_space() -> None:
    gib = 2**30
    assert check_free_space({"/logs": 5 * gib}, gib).status == "PASS"
    low = check_free_space({"/logs": 5 * gib, "/ckpt": gib // 2}, gib)
    assert low.status == "FAIL" and low.detail.startswith("/ckpt has 0.50 GiB free")
    assert check_free_space({"/x": None}, gib).status == "WARN"


def test_line_format() -> None:
    check = check_arrivals(2, [0], 1.0)
    assert check.line().startswith("FAIL ranks: 1 of 2 ranks never showed up")
    assert check.line().endswith(")") and " (hint: " in check.line()
    assert check_arrivals(1, [0], 1.0).line() == "PASS ranks: all 1 ranks reported"


IFACES = [
    netinfo.Interface("lo", True, True, ("127.0.0.1", "::1")),
    netinfo.Interface("docker0", True, False, ("172.17.0.1",)),
    netinfo.Interface("eth0", True, False, ("10.0.0.5",)),
    netinfo.Interface("ib0", True, False, ("10.1.0.5",)),
    netinfo.Interface("eth1", False, False, ()),
]


def test_gloo_choice() -> None:
    named = netinfo.gloo_choice({"GLOO_SOCKET_IFNAME": "eth0,ib0"}, IFACES, "h")
    assert (named.interface, named.address) == ("eth0", "10.0.0.5")
    absent = netinfo.gloo_choice({"GLOO_SOCKET_IFNAME": "ib7"}, IFACES, "h")
    assert absent.interface is None and "names no interface" in absent.reason
    debian = netinfo.gloo_choice({}, IFACES, "h", resolver=lambda _: ["127.0.1.1"])
    assert debian.loopback and debian.interface == "lo"
    broken = netinfo.gloo_choice({}, IFACES, "h", resolver=lambda _: [])
    assert broken.loopback and "no usable address" in broken.reason


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("", "ib0"), ("eth", "eth0"), ("^ib,lo,docker", "eth0"), ("=eth", None), ("lo", "lo")],
)
def test_nccl_choice(spec: str, expected: str | None) -> None:
    env = {"NCCL_SOCKET_IFNAME": spec} if spec else {}
    assert netinfo.nccl_choice(env, IFACES).interface == expected


def test_loopback_addresses() -> None:
    assert all(map(netinfo.is_loopback, ["127.0.0.1", "127.0.1.1", "::1", "localhost"]))
    assert not any(map(netinfo.is_loopback, ["10.0.0.1", "n1", "fe80::1%eth0"]))


def test_this_hosts_interfaces_include_loopback() -> None:
    found = netinfo.interfaces()
    assert any(i.loopback and "127.0.0.1" in i.addresses for i in found)
    assert netinfo.interface_of(route_to("127.0.0.1") or "", found) == "lo"


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("HF_TOKEN", "hf_abc", f"{MASKED} (6 chars)"),
        ("WANDB_API_KEY", "k", f"{MASKED} (1 char)"),
        ("DB_PASSWORD", "p", f"{MASKED} (1 char)"),
        ("AWS_SECRET_ACCESS_KEY", "s", f"{MASKED} (1 char)"),
        ("DDPKIT_STORE", "redis://user:hunter2@db:6379/0", "redis://user:***@db:6379/0"),
        ("NCCL_DEBUG", "INFO", "INFO"),
        ("MASTER_ADDR", "n1", "n1"),
    ],
)
def test_masking(name: str, value: str, shown: str) -> None:
    assert mask(name, value) == shown


def test_relevant_variables_keep_only_launcher_and_backend_ones() -> None:
    env = {"SLURM_JOB_ID": "7", "HOME": "/root", "RANK": "0", "TORCH_HF_TOKEN": "x", "PATH": "/"}
    assert relevant_variables(env) == {
        "RANK": "0",
        "SLURM_JOB_ID": "7",
        "TORCH_HF_TOKEN": f"{MASKED} (1 char)",
    }


def test_bus_bandwidth_factor_and_iterations_as_nccl_tests() -> None:
    assert [commtest.bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]
    assert commtest.FULL_SIZES[0] == 4 and commtest.FULL_SIZES[-1] == 64 * 2**20
    assert commtest.iterations(4, quick=True) == 50 and commtest.iterations(2**26, False) == 3


def test_open_files_sized_for_the_job_with_the_store_host_needing_more() -> None:
    assert open_files_needed(1024, hosts_store=False) == 1023 + 2 + 256
    assert open_files_needed(1024, hosts_store=True) == 1023 + 2 + 256 + 2 * 1024
    assert check_open_files(1024, 20000, 20000, hosts_store=True).status == "PASS"
    # a short soft limit that the hard one lets ddpkit.init raise: said, not a warning
    low = check_open_files(4096, 1024, 524288, hosts_store=True)
    assert low.status == "PASS" and "ulimit -n 1024 < 12545" in low.detail
    assert "ddpkit.init raises it" in low.detail and "`ulimit -n 12545` first" in low.detail
    capped = check_open_files(4096, 1024, 4096, hosts_store=False)
    assert capped.status == "WARN" and capped.hint and "hard limit is 4096" in capped.hint
    # a rank that does not host the store needs no descriptor per store connection
    assert check_open_files(2048, 2400, 2400, hosts_store=False).status == "PASS"
    assert check_open_files(2048, 2400, 2400, hosts_store=True).status == "WARN"


def test_a_launcher_that_hosts_the_store_needs_two_descriptors_a_rank() -> None:
    # torchrun's agent hosts every worker's store; ddpkit cannot raise another process's limit
    need = open_files_needed(512, hosts_store=True)
    ok = check_launcher_open_files(512, 4242, need, need)
    assert ok.status == "PASS" and "the launcher (pid 4242) hosts the job's store" in ok.detail
    short = check_launcher_open_files(512, 4242, 1024, 524288)
    assert short.status == "WARN" and f"ulimit -n 1024 < {need}" in short.detail
    assert short.hint and f"`ulimit -n {need}` before torchrun" in short.hint
    assert "ddpkit run" in short.hint
    capped = check_launcher_open_files(512, 4242, 1024, 1024)
    assert capped.status == "WARN" and capped.hint and "hard limit is 1024" in capped.hint


@pytest.mark.parametrize(
    ("world", "somaxconn", "status"),
    [(8, 4096, "PASS"), (4096, 4096, "PASS"), (4097, 4096, "WARN"), (1024, 128, "WARN"),
     (8, None, "WARN")],
)  # fmt: skip
def test_listen_backlog_against_the_world_size(
    world: int, somaxconn: int | None, status: str
) -> None:
    check = check_listen_backlog(world, somaxconn)
    assert check.status == status
    if somaxconn is not None and status == "WARN":
        assert check.hint and f"net.core.somaxconn={max(4096, world)}" in check.hint


@pytest.mark.parametrize(
    ("took", "status", "words"),
    [(0.004, "PASS", "answered in 4 ms"), (0.6, "WARN", "answered in 0.6 s"),
     (math.inf, "WARN", "not all answered")],
)  # fmt: skip
def test_name_lookup_warns_when_the_resolver_keeps_connects_waiting(
    took: float, status: str, words: str
) -> None:
    check = check_name_lookup("::ffff:127.0.0.1", 16, took)
    assert (check.status, check.name) == (status, "name lookup") and words in check.detail
    assert "16 reverse lookups of ::ffff:127.0.0.1 at once" in check.detail
    if status == "WARN":
        assert check.hint and "'::ffff:127.0.0.1 <this host's name>' to /etc/hosts" in check.hint
