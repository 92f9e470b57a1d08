"""``ddpkit run``'s group ranks in SLURM's node order: the per-round decision, on a real store.

Each agent of a round is a thread calling ``node_order.ordered`` with torch's rank, its hint
(SLURM_NODEID) and one shared torch store, as the agents of a real round share the
rendezvous store. The real rendezvous on the test cluster is
tests/launch/test_node_order_cluster.py.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from torch.distributed import HashStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
from torch.distributed.launcher.api import LaunchConfig

from ddpkit.launch import node_order

TORCHS_MASTER = RendezvousStoreInfo("torch-rank0-host", 1111)


def round_of(hints: list[int | None], *, agent_store: bool = False) -> list[tuple[int, str, int]]:
    """Every agent's (group rank, MASTER_ADDR, MASTER_PORT) after ``ordered``; agent ``i`` is
    torch's rank ``i``, at address ``host-i``."""
    store = HashStore()
    store.set_timeout(timedelta(seconds=20))
    results: list[tuple[int, str, int] | BaseException | None] = [None] * len(hints)

    def agent(rank: int) -> None:
        info = RendezvousInfo(store, rank, len(hints), TORCHS_MASTER)
        try:
            done = node_order.ordered(info, hints[rank], f"host-{rank}", agent_store)
            boot = done.bootstrap_store_info
            assert boot is not None
            results[rank] = (done.rank, boot.master_addr, boot.master_port)
        except BaseException as exc:  # reported below, not lost in the thread
            results[rank] = exc

    threads = [threading.Thread(target=agent, args=(r,)) for r in range(len(hints))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    assert all(isinstance(r, tuple) for r in results), results
    return [r for r in results if isinstance(r, tuple)]


def test_hints_that_number_the_nodes_become_the_group_ranks() -> None:
    found = round_of([2, 0, 1])
    assert [rank for rank, _, _ in found] == [2, 0, 1]
    # the workers' rank 0 hosts their store: MASTER_* now name the agent with hint 0, and a
    # port found free there (RendezvousStoreInfo.build), the same for every agent
    assert {(addr, port) for _, addr, port in found} == {("host-1", found[0][2])}
    assert found[0][2] != TORCHS_MASTER.master_port


def test_with_the_agents_store_shared_master_stays_torchs() -> None:
    found = round_of([1, 0], agent_store=True)
    assert found == [(1, "torch-rank0-host", 1111), (0, "torch-rank0-host", 1111)]


@pytest.mark.parametrize("hints", [[None, None], [0, 0], [0, None], [1, 2], [0, 1, 1]], ids=str)
def test_hints_that_do_not_number_the_nodes_leave_torchs_ranks(
    hints: list[int | None], capsys: pytest.CaptureFixture[str]
) -> None:
    found = round_of(hints)
    assert found == [(r, "torch-rank0-host", 1111) for r in range(len(hints))]
    err = capsys.readouterr().err
    if any(h is not None for h in hints):  # rank 0 says why, once
        assert err.count("ddpkit run: ranks follow the rendezvous' order") == 1, err
    else:
        assert err == ""


def test_one_agent_is_left_alone() -> None:
    info = RendezvousInfo(HashStore(), 0, 1, TORCHS_MASTER)
    assert node_order.ordered(info, 3, "h", False) is info


def test_node_hint_only_inside_a_slurm_step() -> None:
    step = {"SLURM_STEP_ID": "0", "SLURM_NODEID": "1"}
    assert node_order.node_hint(step) == 1
    assert node_order.node_hint({"SLURM_NODEID": "1"}) is None  # salloc shell, batch script
    assert node_order.node_hint({**step, "SLURM_NODEID": "x"}) is None
    for digit in ("²", "３", "٣"):  # isdigit() took "²", which int() then refused
        assert node_order.node_hint({**step, "SLURM_NODEID": digit}) is None


@pytest.mark.parametrize(
    ("backend", "nodes", "env", "used"),
    [
        ("c10d", 2, {"SLURM_STEP_ID": "0"}, True),
        ("c10d", 1, {"SLURM_STEP_ID": "0"}, False),
        ("static", 2, {"SLURM_STEP_ID": "0"}, False),
        ("c10d", 2, {}, False),
    ],
)
def test_the_backend_is_used_for_multi_node_c10d_in_a_slurm_step_only(
    backend: str, nodes: int, env: dict[str, str], used: bool
) -> None:
    config = LaunchConfig(min_nodes=nodes, max_nodes=nodes, nproc_per_node=1)
    config.rdzv_backend = backend
    with node_order.slurm_node_order(config, env):
        assert config.rdzv_backend == (node_order.BACKEND if used else backend)
    assert config.rdzv_backend == backend


@pytest.mark.parametrize("hinted", [True, False])
def test_torchs_c10d_handler_wrapped_numbers_agents_by_their_hints(hinted: bool) -> None:
    """A real c10d rendezvous of two agents (threads of this process, so torch orders them by
    creation); node 1's agent is created first, so torch makes it rank 0; hints win."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from ddpkit.cluster.rendezvous.ports import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    handlers = []
    for node, is_host in ((1, True), (0, False)):
        params = RendezvousParameters(
            backend="c10d",
            endpoint=endpoint,
            run_id="order-test",
            min_nodes=2,
            max_nodes=2,
            is_host=is_host,
            join_timeout=30,
        )
        inner = node_order._torch_c10d_handler(params)
        hint = node if hinted else None
        handlers.append((node, node_order.SlurmOrderedHandler(inner, hint, "127.0.0.1")))
    results: dict[int, RendezvousInfo | BaseException] = {}

    def join(node: int, handler: node_order.SlurmOrderedHandler) -> None:
        try:
            results[node] = handler.next_rendezvous()
        except BaseException as exc:
            results[node] = exc

    threads = [threading.Thread(target=join, args=pair) for pair in handlers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        infos = {node: info for node, info in results.items() if isinstance(info, RendezvousInfo)}
        assert len(infos) == 2, results
        ranks = {node: info.rank for node, info in infos.items()}
        assert ranks == ({0: 0, 1: 1} if hinted else {0: 1, 1: 0})
        assert handlers[0][1].get_backend() == node_order.BACKEND
    finally:
        for _, handler in reversed(handlers):
            handler.shutdown()
