"""ddpkit.init / current / shutdown: real gloo groups in-process (world 1) and spawned (2, 3)."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import FrozenInstanceError
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.errors import ConfigError, RendezvousError, UsageError
from ddpkit.worker import process_group
from ddpkit.worker.rendezvous import group
from ddpkit.worker.rendezvous.store import probe_master
from tests.support.distutil import (
    Indices,
    free_port,
    run_workers,
    torchrun_env,
)
from tests.support.spawned import forked

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shut() -> Iterator[None]:
    """Leave no ddpkit context (or group it made) behind, even when the test fails."""
    yield
    ddpkit.shutdown()


def _info(
    rank: int = 1, port: int = 1, addr: str = "127.0.0.1", launcher: Any = "slurm"
) -> RankInfo:
    return RankInfo(rank, rank, 2, 2, 0, 1, addr, port, launcher)


# --- pure pieces -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "device_type", "expected"),
    [
        ("auto", "cpu", "gloo"),
        ("auto", "cuda", "nccl"),
        ("gloo", "cuda", "gloo"),
        (" gloo ", "cpu", "gloo"),
        ("nccl", "cuda", "nccl"),
        ("cpu:gloo,cuda:nccl", "cpu", "cpu:gloo,cuda:nccl"),
        ("mpi", "cpu", "mpi"),
    ],
)
def test_resolve_backend(backend: str, device_type: str, expected: str) -> None:
    assert process_group.resolve_backend(backend, device_type) == expected


@pytest.mark.parametrize(("backend", "match"), [("nccl", "needs a CUDA device"), ("", "empty")])
def test_resolve_backend_errors(backend: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        process_group.resolve_backend(backend, "cpu")


def test_agent_store_only_under_torchrun_when_the_agent_says_so() -> None:
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert group.uses_agent_store(_info(launcher="torchrun"), agent)
    assert not group.uses_agent_store(_info(launcher="torchrun"), {})
    assert not group.uses_agent_store(
        _info(launcher="torchrun"), {"TORCHELASTIC_USE_AGENT_STORE": "False"}
    )
    assert not group.uses_agent_store(_info(launcher="slurm"), agent)


def test_store_timeout_is_the_collective_one_else_torchs_default() -> None:
    assert process_group.store_timeout("gloo", 12.5) == timedelta(seconds=12.5)
    assert process_group.store_timeout("gloo", None) == dist.constants.default_pg_timeout
    assert process_group.store_timeout("nccl", None) == timedelta(minutes=10)


@pytest.mark.parametrize(
    ("env", "explicit", "expected"),
    [
        ({}, None, 60.0),  # the default
        ({"DDPKIT_CONNECT_TIMEOUT": "2.5"}, None, 2.5),  # env when no argument
        ({"DDPKIT_CONNECT_TIMEOUT": " "}, None, 60.0),  # blank env = unset
        ({}, 7, 7.0),
        ({"DDPKIT_CONNECT_TIMEOUT": "2.5"}, 7, 7.0),  # the explicit argument wins
    ],
)
def test_connect_timeout(env: dict[str, str], explicit: float | None, expected: float) -> None:
    assert process_group.connect_timeout(env, explicit) == expected


@pytest.mark.parametrize(
    ("world", "expected"), [(1, 60.0), (2, 60.01), (1024, 70.23), (4096, 100.95), (96000, 1019.99)]
)
def test_the_default_connect_bound_grows_with_the_world_size(world: int, expected: float) -> None:
    assert process_group.connect_timeout({}, None, world) == pytest.approx(expected)
    # a bound the user set is used as given, whatever the size
    assert process_group.connect_timeout({"DDPKIT_CONNECT_TIMEOUT": "5"}, None, world) == 5.0
    assert process_group.connect_timeout({}, 7, world) == 7.0


@pytest.mark.parametrize(
    ("env", "default", "match"),
    [
        ({"DDPKIT_CONNECT_TIMEOUT": "soon"}, None, "DDPKIT_CONNECT_TIMEOUT='soon'"),
        ({"DDPKIT_CONNECT_TIMEOUT": "-1"}, None, "DDPKIT_CONNECT_TIMEOUT='-1'"),
        ({"DDPKIT_CONNECT_TIMEOUT": "inf"}, None, "DDPKIT_CONNECT_TIMEOUT='inf'"),
        ({}, 0, "connect_timeout_s=0"),
    ],
)
def test_connect_timeout_errors(env: dict[str, str], default: float | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        process_group.connect_timeout(env, default)


# --- the master probe --------------------------------------------------------------------


def test_probe_waits_for_a_late_master() -> None:
    listener = socket.socket()
    port = free_port()

    def open_late() -> None:
        listener.bind(("127.0.0.1", port))
        listener.listen()

    timer = threading.Timer(0.6, open_late)
    timer.start()
    try:
        started = time.monotonic()
        probe_master(_info(port=port), 15.0)  # raises at its 15 s bound
        assert time.monotonic() - started > 0.5  # it waited for the listener
    finally:
        timer.join()
        listener.close()


def test_probe_of_a_tcpstore_is_silent(capfd: pytest.CaptureFixture[str]) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=5), wait_for_workers=False)
    for _ in range(3):
        probe_master(_info(port=store.port), 5.0)
    time.sleep(0.3)  # the store logs from its own thread
    store.set("still", "works")
    assert store.get("still") == b"works"
    del store
    captured = capfd.readouterr()
    assert "c10d" not in captured.err + captured.out


def test_rank1_fails_fast_when_master_unreachable(shut: None) -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(RendezvousError) as caught:  # at the bound it names ("1 s")
        ddpkit.init(env=torchrun_env(1, 2, port), connect_timeout_s=1.0)
    message = str(caught.value)
    for part in (f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}", "launcher torchrun", "rank 1", "1 s"):
        assert part in message
    for cause in ("rank 0 has not started or crashed", "localhost", "firewall", "taken"):
        assert cause in message
    assert not dist.is_initialized()
    with pytest.raises(UsageError):
        ddpkit.current()


def test_connect_timeout_from_env_when_no_argument(shut: None) -> None:
    port = free_port()
    env = torchrun_env(1, 2, port, DDPKIT_CONNECT_TIMEOUT="0.5")
    with pytest.raises(RendezvousError, match=r"within 0\.5 s"):  # the variable's bound
        ddpkit.init(env=env)


def test_rank0_port_taken_is_a_rendezvous_error(shut: None) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"port {port} is taken"):
            ddpkit.init(env=torchrun_env(0, 2, port))
    assert not dist.is_initialized()


# --- world size 1, in this process ----------------------------------------------------------


def test_current_before_init_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"init\(\) has not been called") as caught:
        ddpkit.current()
    assert caught.value.hint is not None and "ddpkit.init()" in caught.value.hint


def test_world_of_one(shut: None) -> None:
    ctx = ddpkit.init(env={})
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.is_main) == (0, 1, 0, True)
    assert ctx.info.launcher == "single"
    assert ctx.info.master_port == 0  # no port: a world of one has no network store
    assert ctx.device == torch.device("cpu") and ctx.backend == "gloo"
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert ddpkit.init(env={"RANK": "ignored"}) is ctx  # idempotent: same context
    assert ddpkit.current() is ctx
    with pytest.raises(FrozenInstanceError):
        ctx.backend = "nccl"  # type: ignore[misc]
    ddpkit.shutdown()
    assert not dist.is_initialized()
    with pytest.raises(UsageError):
        ddpkit.current()
    ddpkit.shutdown()  # a second shutdown is harmless


def test_explicit_backend_and_device_override(shut: None) -> None:
    ctx = ddpkit.init(backend="gloo", timeout_s=30, env={}, device="cpu")
    assert (ctx.backend, ctx.device) == ("gloo", torch.device("cpu"))
    assert dist.get_backend() == "gloo"


def test_bad_timeout_leaves_no_group(shut: None) -> None:
    with pytest.raises(ConfigError, match="timeout_s=0"):
        ddpkit.init(env={}, timeout_s=0)
    assert not dist.is_initialized()


_AT_EXIT = """
import atexit, torch.distributed as dist, ddpkit
# Registered first, so it runs after ddpkit's own exit handler (atexit is last-in, first-out).
atexit.register(lambda: print("group at exit:", dist.is_initialized()))
if {foreign}:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
ddpkit.init(env={{}})
"""


def test_exit_destroys_only_a_group_ddpkit_created(tmp_path: Path) -> None:
    """Each process forked from the fork server (torch imported once), ending as an
    interpreter does: its threads, then its atexit handlers, where ddpkit's exit runs."""
    for foreign in (False, True):
        script = tmp_path / f"foreign-{foreign}" / "at_exit.py"
        script.parent.mkdir()
        script.write_text(_AT_EXIT.format(foreign=foreign, port=free_port()))
        [seen] = forked(script, 1, [], bound_s=60, timeout_s=60)
        assert seen.code == 0, seen.err
        assert seen.out.strip() == f"group at exit: {foreign}", seen.err


def test_bad_backend_leaves_no_group(shut: None) -> None:
    with pytest.raises(ConfigError, match="backend='nccl'"):
        ddpkit.init(backend="nccl", env={})
    assert not dist.is_initialized()


def test_notes_warn_once(shut: None) -> None:
    batch_script = {
        "SLURM_JOB_ID": "77",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "0",
        "SLURM_NODELIST": "n1",
    }
    with pytest.warns(RuntimeWarning, match="SLURM_NTASKS=4"):
        ctx = ddpkit.init(env=batch_script)
    assert ctx.world_size == 1 and ctx.info.notes
    ddpkit.shutdown()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddpkit.init(env=batch_script)  # the same note again: not repeated


def test_group_destroyed_behind_our_back_is_rejoined(shut: None) -> None:
    first = ddpkit.init(env={})
    dist.destroy_process_group()
    second = ddpkit.init(env={})
    assert second is not first and dist.is_initialized()


def test_a_group_a_model_still_holds_is_kept_past_shutdown_until_the_next_init(
    shut: None,
) -> None:
    """shutdown() destroys the group; while a DDP model still refers to it, its Python handle
    is kept (freed by its own destructor, which releases the GIL, not by the model's Reducer);
    the next init() or shutdown() lets it go; a group nothing refers to is not kept."""
    ddpkit.init(env={})
    model = ddpkit.wrap(torch.nn.Linear(2, 2), "ddp")
    held = dist.group.WORLD
    ddpkit.shutdown()
    assert not dist.is_initialized()
    assert process_group._RETIRED[0] is held and len(process_group._RETIRED) == 1
    del model, held
    ddpkit.init(env={})
    assert process_group._RETIRED == []
    ddpkit.shutdown()
    assert process_group._RETIRED == []  # nothing referred to this one


def test_a_group_over_several_nodes_names_the_routes_interface_for_its_one_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ``launch: srun`` no agent sets GLOO_/NCCL_SOCKET_IFNAME: init_process_group gets
    the interface of the route to the rendezvous host, then the environment is as before; a
    variable the user set is theirs; one node, or no route known, sets nothing."""
    asked: list[str] = []

    def route(host: str, env: Any) -> str | None:
        asked.append(host)
        return None if host == "unroutable" else "ib7"

    monkeypatch.setattr(process_group, "job_interface", route)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    nodes = RankInfo(1, 0, 4, 2, 0, 2, "n1", 29500, "slurm")

    def inside(info: RankInfo, backend: str = "gloo", one_host: bool = False) -> list[Any]:
        with process_group._interface_vars(info, {}, backend, one_host):
            seen = [os.environ.get(n) for n in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")]
        assert "GLOO_SOCKET_IFNAME" not in os.environ or seen[0] == "users0"  # put back
        return seen

    assert inside(nodes) == ["ib7", "ib7"] and asked == ["n1"]
    assert inside(nodes, "nccl") == ["ib7", "ib7"]
    assert inside(dataclasses.replace(nodes, master_addr="unroutable")) == [None, None]
    assert inside(dataclasses.replace(nodes, num_nodes=1)) == [None, None]
    assert inside(nodes, one_host=True)[0] in ("lo", "lo0")  # every rank here: loopback
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "users0")
    assert inside(nodes) == ["users0", "ib7"]  # the user's choice kept, NCCL's still named


# --- world sizes 2 and 3, spawned -----------------------------------------------------------


def _init_worker(rank: int, world_size: int, port: int, adopt_port: int) -> dict[str, Any]:
    env_before = dict(os.environ)
    env = torchrun_env(rank, world_size, port)
    ctx = ddpkit.init(env=env, connect_timeout_s=30)
    seen: dict[str, Any] = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "local_rank": ctx.local_rank,
        "is_main": ctx.is_main,
        "device": str(ctx.device),
        "backend": ctx.backend,
        "launcher": ctx.info.launcher,
        "same_again": ddpkit.init(env=env) is ctx and ddpkit.current() is ctx,
        "dist": (dist.get_rank(), dist.get_world_size()),
    }
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    seen["sum"] = total.item()
    ddpkit.shutdown()
    seen["group_after_shutdown"] = dist.is_initialized()
    # Someone else's group: adopted, and left alone by shutdown(). env={} says "single", so
    # the group's numbers must win over detection's.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{adopt_port}", rank=rank, world_size=world_size
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adopted = ddpkit.init(env={})
    seen["adopted"] = (adopted.rank, adopted.world_size, adopted.backend)
    seen["adopt_warned"] = any(
        "adopting the existing process group" in str(w.message) for w in caught
    )
    ddpkit.shutdown()
    seen["foreign_group_alive"] = dist.is_initialized()
    dist.barrier()
    dist.destroy_process_group()
    seen["environ_unchanged"] = dict(os.environ) == env_before
    return seen


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 3])
def test_init_in_a_real_group(world_size: int) -> None:
    results = run_workers(_init_worker, world_size, free_port())
    for rank, seen in enumerate(results):
        assert seen["rank"] == rank and seen["dist"] == (rank, world_size)
        assert (seen["world_size"], seen["local_rank"], seen["is_main"]) == (
            world_size,
            rank,
            rank == 0,
        )
        assert (seen["device"], seen["backend"], seen["launcher"]) == ("cpu", "gloo", "torchrun")
        assert seen["same_again"]
        assert seen["sum"] == world_size * (world_size + 1) / 2
        assert seen["group_after_shutdown"] is False
        assert seen["adopted"] == (rank, world_size, "gloo")
        assert seen["adopt_warned"]  # env={} says rank 0 of 1; the group differs
        assert seen["foreign_group_alive"] is True
        assert seen["environ_unchanged"]


# init() under a real torchrun (env=None, the agent's store, every rank its client, a group that
# all-reduces): the torchrun launch of tests/worker/rendezvous/test_store.py's
# test_torchrun_hosting_the_store_without_the_open_files_it_needs_has_rank_0_say_so.


def _epoch_gathered(size: int) -> tuple[list[int], list[int]]:
    """This rank's samples of one epoch over Indices(size), and every rank's, gathered."""
    mine: list[int] = []
    every: list[int] = []
    for batch in ddpkit.loader(Indices(size), 2, shuffle=False):
        mine += batch.tolist()
        every += ddpkit.gather(batch).tolist()
    return mine, every


def _plain_group_worker(rank: int, world_size: int, port: int, ports: list[int]) -> dict[str, Any]:
    """Groups made by plain torch.distributed: without init(), and behind init()'s back."""
    url = "tcp://127.0.0.1:{}"
    seen: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # adoption notices: env says nothing of this group
        dist.init_process_group(
            "gloo", init_method=url.format(port), rank=rank, world_size=world_size
        )
        ctx = ddpkit.current()
        seen["no_init"] = (ctx.rank, ctx.world_size, ctx.is_main, str(ctx.device))
        seen["epoch"] = _epoch_gathered(7)
        dist.barrier()
        dist.destroy_process_group()
        seen["gone"] = ddpkit.worker.context.current_or_none() is None
        # init()'s own group, destroyed and replaced behind its back (ranks reversed)
        ddpkit.init(env=torchrun_env(rank, world_size, ports[0]))
        dist.barrier()
        dist.destroy_process_group()
        flipped = world_size - 1 - rank
        dist.init_process_group(
            "gloo", init_method=url.format(ports[1]), rank=flipped, world_size=world_size
        )
        seen["replaced"] = (ddpkit.current().rank, ddpkit.current().world_size)
        seen["replaced_epoch"] = _epoch_gathered(7)
        ddpkit.shutdown()  # as at exit: init()'s group is gone, this one is not ddpkit's
        seen["replacement_spared"] = dist.is_initialized()
        adopted = ddpkit.init(env={})  # a full init() still adopts it
        seen["init_after"] = (adopted.rank, adopted is ddpkit.current())
        ddpkit.shutdown()
        seen["left_alone"] = dist.is_initialized()  # not ddpkit's to destroy
        dist.barrier()
        dist.destroy_process_group()
    return seen


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_come_from_the_group_that_exists(world_size: int) -> None:
    results = run_workers(_plain_group_worker, world_size, [free_port(), free_port()])
    for rank, seen in enumerate(results):
        assert seen["no_init"] == (rank, world_size, rank == 0, "cpu"), rank
        flipped = world_size - 1 - rank
        assert seen["replaced"] == (flipped, world_size), rank
        assert seen["init_after"] == (flipped, True), rank
        assert seen["gone"] and seen["replacement_spared"] and seen["left_alone"], rank
        for key, shard_rank in (("epoch", rank), ("replaced_epoch", flipped)):
            mine, every = seen[key]
            padded = (list(range(7)) * 2)[: -(-7 // world_size) * world_size]  # the sampler's
            assert mine == padded[shard_rank::world_size], key
            assert every == list(range(7)), key  # each sample once, none twice


def _returns_then_leaves(rank: int, world_size: int, port: int, at: str) -> float:
    if rank > 0:  # this rank's group forms a second late: as gloo's accepting side can
        made_by_torch = dist.init_process_group

        def slow(*args: Any, **kwargs: Any) -> None:
            made_by_torch(*args, **kwargs)
            time.sleep(1.0)
            Path(at, f"formed{rank}").write_text(repr(time.time()))

        dist.init_process_group = slow  # this worker process only
    # a run the launcher names (as torchrun does): no agreement on a drawn run id meets the ranks
    env = torchrun_env(rank, world_size, port, TORCHELASTIC_RUN_ID="named")
    ddpkit.init(env=env, connect_timeout_s=30)
    returned = time.time()
    ddpkit.shutdown()  # at once, as a short script or a tool does
    return returned


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 3])
def test_init_returns_only_once_every_ranks_group_is_formed(
    world_size: int, tmp_path: Path
) -> None:
    # Else rank 0 could end its group under a rank still making its own, which then failed
    # with gloo's "Connection closed by peer" (see process_group._formed_everywhere).
    returned = run_workers(_returns_then_leaves, world_size, str(tmp_path))
    formed = [float(Path(tmp_path, f"formed{rank}").read_text()) for rank in range(1, world_size)]
    assert returned[0] > max(formed), (returned, formed)


def _leaves_before_meeting(rank: int, world_size: int, port: int) -> tuple[str, str, bool]:
    if rank > 0:  # this rank's group is made, then ended before it meets the others
        process_group._formed_everywhere = dist.destroy_process_group  # this worker only
    env = torchrun_env(rank, world_size, port, TORCHELASTIC_RUN_ID="named")
    try:
        ddpkit.init(env=env, connect_timeout_s=30, timeout_s=60, peer_timeout_s=0)
    except Exception as exc:
        return type(exc).__name__, str(exc), dist.is_initialized()
    finally:
        ddpkit.shutdown()
    return "returned", "", dist.is_initialized()


@pytest.mark.multiproc
def test_a_peer_that_leaves_before_the_group_met_ends_init_in_one_line() -> None:
    (kind, message, group_left), _ = run_workers(_leaves_before_meeting, 2)
    assert kind == "RendezvousError" and "\n" not in message, message
    assert "but the group did not form" in message and "crashed" in message, message
    assert group_left is False  # the half-made group is destroyed, not left behind
