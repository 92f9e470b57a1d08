"""Where the rendezvous store listens, and that joining never waits unbounded on its port.

Real sockets throughout: listeners are read from /proc (tests/support/sockets.py), the squatters are
real listener threads, and every init() under test is a real one in its own process: forked by
``run_workers``'s server (torch imported once, the process's environment set as a launcher's
would be; what each such rank runs is in store_ranks.py, a module without pytest), or, where
what a user sees of a whole interpreter is the point (its stderr to the end, the launchers), a
new interpreter.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import ddpkit.worker.rendezvous.store as store_module
from ddpkit.cli.run import config_from_argv
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.launch.local import build_launch_config
from ddpkit.worker.rendezvous.store import (
    connect_client,
    loopback_address,
    store_endpoint,
)
from tests.support.distutil import free_port, run_workers, torchrun_env
from tests.support.needs import missing
from tests.support.pids import wait_until_stopped
from tests.support.sockets import WILDCARDS, is_loopback, listening, routable_interface
from tests.worker.rendezvous import store_ranks as ranks

ROOT = Path(__file__).resolve().parents[3]
_LAUNCHER_PREFIXES = (
    "SLURM_",
    "MASTER_",
    "TORCHELASTIC_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MV2_",
    "MPI_",
    "SUBMITIT_",
    "DDPKIT_",
    "GROUP_",
    "ROLE_",
)
_LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any launcher's variables, importing this tree's ddpkit and helpers."""
    keep = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_VARS
    }
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])  # ROOT: tests.support
    return {**keep, "PYTHONPATH": path, **extra}


# --- where the store listens: the rule ----------------------------------------------------


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.1.1", "127.0.1.1"),  # Debian's line for the host name: loopback too
        ("localhost", "127.0.0.1"),
        ("LOCALHOST", "127.0.0.1"),
        ("::1", "::1"),
        ("[::1]", "::1"),
        ("10.0.0.5", None),
        ("fe80::1", None),
        ("node-1", None),  # never resolved: it may be loopback here and not elsewhere
        ("0.0.0.0", None),
    ],
)
def test_loopback_address(addr: str, expected: str | None) -> None:
    assert loopback_address(addr) == expected


def _info(addr: str, num_nodes: int, launcher: Any = "slurm") -> RankInfo:
    return RankInfo(1, 1, 4, 4 // num_nodes, 0, num_nodes, addr, 29500, launcher)


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        (_info("127.0.0.1", 2), ("127.0.0.1", "127.0.0.1")),  # loopback named: bound there
        (_info("localhost", 1), ("127.0.0.1", "127.0.0.1")),
        (_info("::1", 2), ("::1", "::1")),
        (_info("gpu07", 1), ("127.0.0.1", "127.0.0.1")),  # one node: loopback whatever named
        (_info("10.1.2.3", 1, "mpi"), ("127.0.0.1", "127.0.0.1")),
        (_info("gpu07", 2), ("gpu07", None)),  # several nodes: every interface, as torch
        (_info("10.1.2.3", 4, "torchrun"), ("10.1.2.3", None)),
    ],
)
def test_store_endpoint(info: RankInfo, expected: tuple[str, str | None]) -> None:
    assert store_endpoint(info) == expected


def test_a_store_on_a_loopback_socket_listens_there_only_and_is_shared() -> None:
    """What the placement relies on from torch: ``master_listen_fd`` (public) keeps the
    server on that socket, a multi-tenant store on the same host and port shares it, and the
    server closes the socket when the last store goes."""
    from datetime import timedelta

    import torch.distributed as dist

    from ddpkit.worker.rendezvous.store import host_tcp_store

    timeout = timedelta(seconds=30)
    store = host_tcp_store(
        "127.0.0.1", 0, bind="127.0.0.1", world_size=None, timeout=timeout, multi_tenant=True
    )
    port = store.port
    assert [pair for pair in listening() if pair[1] == port] == [("127.0.0.1", port)]
    twin = dist.TCPStore("127.0.0.1", port, None, True, timeout, multi_tenant=True)
    store.set("key", "shared")
    assert twin.get("key") == b"shared"
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout)
    assert client.get("key") == b"shared" and store.clone().get("key") == b"shared"
    del store, twin, client
    assert [pair for pair in listening() if pair[1] == port] == []


# --- a world of one: no network store ------------------------------------------------------


_WORLD_OF_ONE = """
import json, os
from tests.worker.rendezvous.store_ranks import world_of_one
print(json.dumps(world_of_one(0, 1, 0, dict(os.environ), "auto")))
"""


@pytest.mark.parametrize(
    "extra",
    [{}, {"MASTER_PORT": "port"}, {"RANK": "0", "WORLD_SIZE": "1"}],
    ids=["plain", "master-port-set", "env-world-of-one"],
)
def test_a_world_of_one_listens_on_no_network_port(extra: dict[str, str]) -> None:
    # Before: torch's TCPStore on [::]:port (every interface, no authentication). gloo's own
    # listener stays (one, per device): GLOO_SOCKET_IFNAME=lo keeps it on loopback here, so
    # the test is the same on a machine whose host name resolves to a routable address.
    # MASTER_PORT without RANK in a process multiprocessing started is refused (an mp.spawn
    # that forgot RANK): that case runs in an interpreter of its own, as a user's script does.
    extra = {k: str(free_port()) if v == "port" else v for k, v in extra.items()}
    env = clean_env(GLOO_SOCKET_IFNAME="lo", **extra)
    if "MASTER_PORT" in extra:
        done = subprocess.run(
            [sys.executable, "-c", _WORLD_OF_ONE],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
    else:
        [seen] = run_workers(ranks.world_of_one, 1, env, "auto", timeout_s=120)
    assert (seen["world"], seen["sum"]) == (1, 1.0)
    assert seen["before"] == []
    after = [tuple(pair) for pair in seen["after"]]
    assert not [pair for pair in after if pair[0] in WILDCARDS], after
    assert all(is_loopback(addr) for addr, _ in after), after
    assert len(after) == 1, f"only gloo's own listener may remain: {after}"
    if "MASTER_PORT" in extra:
        assert int(extra["MASTER_PORT"]) not in [port for _, port in after]
    assert seen["store"] == "HashStore"


def _routable_interface() -> tuple[str, str]:
    found = routable_interface()
    if found is None:  # a machine with loopback only cannot show the difference
        missing("no network interface with an IPv4 address other than loopback on this machine")
    return found


@pytest.mark.parametrize("backend", ["auto", "gloo"])
def test_a_world_of_one_keeps_its_backends_listener_on_loopback(backend: str) -> None:
    # Before: gloo listened on the interface GLOO_SOCKET_IFNAME names (a cluster profile's
    # "eth0", "ib0"), or on the address the host name resolves to, reachable from that network
    # although nobody ever joins a world of one. The user's setting is back after init().
    name, address = _routable_interface()
    env = clean_env(GLOO_SOCKET_IFNAME=name)
    [seen] = run_workers(ranks.world_of_one, 1, env, backend, timeout_s=120)
    after = [tuple(pair) for pair in seen["after"]]
    assert (seen["world"], seen["sum"], len(after)) == (1, 1.0, 1), after  # gloo's listener
    assert all(is_loopback(addr) for addr, _ in after), f"{name} is {address}: {after}"
    assert seen["ifname"] == name


# --- several ranks on this host: the store on loopback only ---------------------------------


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["torchrun-vars", "slurm-one-node", "slurm-port-search"])
def test_a_one_node_job_hosts_its_store_on_loopback(kind: str) -> None:
    # Before: rank 0's store listened on [::]:port, reachable from every network of the node.
    results = run_workers(ranks.store_listener, 2, kind, timeout_s=180)
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert {r["addr"] for r in results} == {"127.0.0.1"}
    assert [tuple(pair) for pair in results[0]["listeners"]] == [
        ("127.0.0.1", results[0]["listeners"][0][1])
    ], results[0]["listeners"]
    assert results[1]["listeners"] == []  # rank 1 hosts nothing


_REPORT = """
import json, os, resource, sys, warnings
import torch, torch.distributed as dist
import ddpkit
from ddpkit.worker.rendezvous import group
from tests.support.sockets import listening
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ctx = ddpkit.init()
total = torch.tensor([1.0])
dist.all_reduce(total)
agent = listening(os.getppid())  # torch's agent is the workers' parent
mine = listening()
parent = resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE)  # the agent's open-files limit
said = [str(w.message) for w in caught if "the launcher (pid" in str(w.message)]
dist.barrier()
with open(os.path.join(sys.argv[1], f"rank{ctx.rank}.json"), "w") as out:
    json.dump({"agent": agent, "mine": mine, "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
               "parent": list(parent), "ppid": os.getppid(), "said": said,
               "rank": ctx.rank, "world": ctx.world_size, "sum": total.item(),
               "agent_store": group.uses_agent_store(ctx.info, os.environ)}, out)
dist.barrier()
ddpkit.shutdown()
"""


def _low_open_files() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (200, 4096))


# What a rank can show of its agent without torch: the agent's listeners, the place it was given
# and whether it is a client of the agent's store (torchrun's variable, read as init() reads it).
_AGENT_REPORT = """
import json, os, sys
from ddpkit.cluster.detect import detect
from tests.support.sockets import listening
info = detect()
shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
agent_store = info.launcher == "torchrun" and shared
with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as out:
    json.dump({"agent": listening(os.getppid()), "rank": info.rank, "world": info.world_size,
               "master_port": info.master_port, "agent_store": agent_store}, out)
"""


def _report_of(
    folder: Path,
    launcher: list[str],
    env: dict[str, str],
    *,
    low_open_files: bool = False,
    payload: str = _REPORT,
) -> list[dict[str, Any]]:
    """``launcher`` (a command line ending with its flags) running ``payload`` (_REPORT: ranks
    that form the group) on 2 ranks; each rank's report."""
    script = folder / "report.py"
    script.write_text(payload)
    done = subprocess.run(
        [*launcher, str(script), str(folder)],
        env=env,
        preexec_fn=_low_open_files if low_open_files else None,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]


_DDPKIT_RUN = [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2"]


def _ddpkit_run_on_one_node(folder: Path) -> tuple[str, list[dict[str, Any]]]:
    """One ``ddpkit run --nproc-per-node 2`` (one node, no --master-port: --standalone, implied),
    GLOO_SOCKET_IFNAME naming a network interface (lo on a machine with none), started with a
    soft open-files limit of 200: (that name, the ranks' reports)."""
    found = routable_interface()
    ifname = "lo" if found is None else found[0]
    env = clean_env(GLOO_SOCKET_IFNAME=ifname)
    return ifname, _report_of(folder, _DDPKIT_RUN, env, low_open_files=True)


def test_one_node_without_a_master_port_is_the_standalone_launch() -> None:
    """What lets the launch above stand for ``--standalone`` given: the same launch."""
    implied, given = (
        build_launch_config(config_from_argv(["--nproc-per-node", "2", *flag, __file__]))
        for flag in ([], ["--standalone"])
    )
    for plan in (implied, given):
        config = plan.launch_config
        assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "localhost:0")
        assert plan.shared_store_bind == "127.0.0.1"


def _listens_on_loopback_only(reports: list[dict[str, Any]], gloo_ifname: str) -> None:
    # Before: the agent's rendezvous store and rank 0's worker store on [::] (every interface);
    # and gloo's listeners on the interface GLOO_SOCKET_IFNAME named ("gloo-on-a-network"),
    # although every peer is on this host. The user's variable is back after init().
    for rank, seen in enumerate(reports):
        assert seen["agent"], "the agent hosts the rendezvous store"
        assert seen["mine"], "gloo listens in every rank"
        for addr, port in seen["agent"] + seen["mine"]:
            assert is_loopback(addr), f"rank {rank}: a listener on {addr}:{port}"
        assert seen["ifname"] == gloo_ifname
        assert (seen["rank"], seen["world"], seen["sum"]) == (rank, 2, 2.0), seen


@pytest.mark.multiproc
def test_ddpkit_run_on_one_node_listens_on_loopback_only_and_has_the_open_files_it_needs(
    tmp_path: Path,
) -> None:
    """The standalone launch (gloo on a network, where the machine has a network interface),
    started with a soft open-files limit of 200: one launch for both guarantees (one test, not
    a shared fixture, which xdist's worksteal could run once per worker). ddpkit run raises
    its own limit, so rank 0 says nothing."""
    from ddpkit.cluster.limits import open_files_needed

    gloo_ifname, reports = _ddpkit_run_on_one_node(tmp_path)
    _listens_on_loopback_only(reports, gloo_ifname)
    rank0, rank1 = reports
    need = open_files_needed(2, hosts_store=True)
    assert rank0["parent"] == [need, 4096], "ddpkit run raised its own open-files limit"
    assert rank0["said"] == [] and rank1["said"] == []
    if gloo_ifname == "lo":  # the launch had no network to name
        _routable_interface()  # says so


@pytest.mark.multiproc
def test_ddpkit_run_with_a_master_port_listens_on_loopback_only(tmp_path: Path) -> None:
    """The static launch: its agent hosts the store on the master port, on loopback only, and
    the ranks are its clients (so no rank hosts one). Torch-free ranks: what a rank of ddpkit
    run listens on itself (gloo; no store as the agent's client) is the standalone launch's
    test above, the same init() path."""
    port = free_port()
    reports = _report_of(
        tmp_path, [*_DDPKIT_RUN, "--master-port", str(port)], clean_env(), payload=_AGENT_REPORT
    )
    for rank, seen in enumerate(reports):
        assert (seen["rank"], seen["world"], seen["master_port"]) == (rank, 2, port), seen
        assert seen["agent_store"] is True, f"rank {rank} is no client of the agent's store"
        assert ("127.0.0.1", port) in [tuple(pair) for pair in seen["agent"]], seen
        for addr, listened in seen["agent"]:
            assert is_loopback(addr), f"rank {rank}: the agent listens on {addr}:{listened}"


# --- a MASTER_PORT held by something that is not a store ----------------------------------


@contextmanager
def _squatter(mode: str) -> Iterator[int]:
    """A real listener on 127.0.0.1 that accepts, then never answers ("silent"), closes at
    once ("close") or sends bytes that are no TCPStore reply ("garbage"); or another job's
    real store ("store"), which answers but where this job's peers never appear."""
    if mode == "store":
        from datetime import timedelta

        import torch.distributed as dist

        other = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=600))
        yield other.port
        del other
        return
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            held.append(conn)
            if mode == "close":
                conn.close()
            elif mode == "garbage":
                conn.sendall(b"\xff\x00HTTP/1.1 400 Bad Request\r\n\r\n" * 4)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for conn in held:
            conn.close()


def _launcher_env(launcher: str, port: int) -> dict[str, str]:
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if launcher == "torchrun":
        return torchrun_env(1, 2, port)
    if launcher == "torchrun-agent":  # the agent's store: rank 0 is a client too
        return torchrun_env(0, 2, port, TORCHELASTIC_USE_AGENT_STORE="True")
    assert launcher == "slurm"
    return {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_STEP_NODELIST": "n1",
        **master,
    }


# (squatter, launcher, connect timeout s, collective timeout s)
_CASES = [
    ("silent", "torchrun", 1, 2),
    ("silent", "torchrun", 3, 1),
    ("silent", "torchrun", 6, 3),
    ("silent", "torchrun-agent", 2, 2),
    ("silent", "slurm", 1, 1),
    ("close", "torchrun", 1, 1),
    ("close", "slurm", 2, 3),
    ("garbage", "torchrun", 1, 1),
    ("garbage", "torchrun-agent", 2, 1),
    ("store", "torchrun", 1, 2),
    ("store", "slurm", 2, 1),
]


@pytest.mark.multiproc
def test_a_master_port_held_by_something_else_ends_init_within_its_timeouts() -> None:
    # Before: the silent listener held rank 1 in torch's TCPStore handshake for good (no bound
    # at all); "close"/"garbage" ended after torch's own retries with a hint about EADDRINUSE;
    # another job's store ended at the collective timeout in torch's words (DistStoreError).
    # The cases run at once, each in a process of its own forked from run_workers' server, so
    # the test takes about its longest bounds (6 s connect, 3 s collective). Each ends with
    # the error that names its cause, the bound it gave up at for another job's store; the
    # guard against a wait without end is run_workers' timeout, far above every bound.
    with ExitStack() as stack:
        cases, ports = [], []
        for mode, launcher, connect_s, collective_s in _CASES:
            port = stack.enter_context(_squatter(mode))
            cases.append((clean_env(**_launcher_env(launcher, port)), connect_s, collective_s))
            ports.append(port)
        results = run_workers(ranks.join, len(cases), cases, timeout_s=150)
    for (mode, launcher, connect_s, collective_s), port, seen in zip(
        _CASES, ports, results, strict=True
    ):
        case = f"{mode} listener, {launcher}, timeouts {connect_s}/{collective_s} s"
        assert "error" in seen, f"{case}: {seen}"
        message = seen["error"]
        assert "\n" not in message, case
        why = (
            (
                "but the group did not form",
                f"(collective timeout {collective_s:g} s)",
                "another job's store on that port",
            )
            if mode == "store"
            else (
                "accepts connections but does not speak the TCPStore protocol",
                "another service holds port",
            )
        )
        for part in (f"127.0.0.1:{port}", f"(launcher {launcher.split('-')[0]})", *why):
            assert part in message, f"{case}: {message}"


def test_a_store_that_answers_late_is_still_joined() -> None:
    """The bound cuts a store that never answers, not one that comes up late: rank 1 starts
    first, rank 0's real store appears a moment later (several moments: ~15 s, four 2-process
    jobs; the last after rank 1 asked for it several times)."""
    for delay_s in (0.0, 0.5, 2.0, 4.0):
        results = run_workers(ranks.late_master, 2, delay_s, timeout_s=120)
        assert [r["sum"] for r in results] == [3.0, 3.0], delay_s


# --- a rank's connect: the store asked first, torch's client only once it answered --------


class _Spy:
    """Counts the handshakes connect_client asks and the torch clients it makes (each still
    made for real); ``asked`` is set once the first ask has failed, ``times`` notes when (for
    the tests' failure messages)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.asks = 0
        self.clients = 0
        self.asked = threading.Event()
        self.started = time.monotonic()
        self.times: dict[str, float] = {}
        ask, client = store_module.store_answers, store_module.TCPStore

        def counted_ask(*args: Any) -> None:
            self.asks += 1
            try:
                ask(*args)
            finally:
                self.note("asked")
                self.asked.set()

        def counted_client(*args: Any, **kwargs: Any) -> Any:
            self.clients += 1
            return client(*args, **kwargs)

        monkeypatch.setattr(store_module, "store_answers", counted_ask)
        monkeypatch.setattr(store_module, "TCPStore", counted_client)

    def note(self, what: str) -> None:
        self.times.setdefault(what, round(time.monotonic() - self.started, 2))

    def after_ask(self, action: Callable[[], Any], delay_s: float) -> threading.Thread:
        """A started thread that runs ``action`` ``delay_s`` after the first ask returned."""

        def run() -> None:
            self.asked.wait(20.0)
            time.sleep(delay_s)
            self.note("acted")
            action()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def _rank1(port: int) -> RankInfo:
    return RankInfo(1, 1, 2, 2, 0, 1, "127.0.0.1", port, "torchrun")


def _host(port: int, *, use_libuv: bool = True) -> Any:
    from torch.distributed import TCPStore  # not the spied one

    return TCPStore(
        "127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False,
        use_libuv=use_libuv,
    )  # fmt: skip


@pytest.mark.parametrize("use_libuv", [True, False])
def test_a_rank_joining_a_store_that_is_up_asks_once_and_makes_one_client(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], use_libuv: bool
) -> None:
    """Both of torch's store servers answer the handshake; asking logs nothing there."""
    port = free_port()
    host = _host(port, use_libuv=use_libuv)
    spy = _Spy(monkeypatch)
    client = connect_client(_rank1(port), 10.0, timedelta(seconds=10))
    client.set("from", "rank 1")
    assert host.get("from") == b"rank 1"
    assert (spy.asks, spy.clients) == (1, 1)
    del client, host
    captured = capfd.readouterr()
    assert "c10d" not in captured.err + captured.out


def test_a_joining_rank_writes_nothing_to_the_store_no_check_in_nobody_waits_for() -> None:
    """torch's client given the world size adds to a check-in key (``init/``) that only a host
    made with ``wait_for_workers=True`` reads; ddpkit's host waits on no key (the group's
    forming is the barrier), torchrun's agent store is past its own wait before any worker
    starts: one store round trip a rank, at the store every rank shares, for nothing."""
    port = free_port()
    host = _host(port)
    info = RankInfo(1, 1, 64, 64, 0, 1, "127.0.0.1", port, "torchrun")
    client = connect_client(info, 10.0, timedelta(seconds=10))
    assert host.num_keys() == 0
    client.set("from", "rank 1")
    assert host.get("from") == b"rank 1"  # waits for it: a set has no reply
    assert host.num_keys() == 1


def test_a_late_master_is_asked_for_again_and_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens at first: the rank asks again (at least every second) and joins the
    store once it is up, with one torch client."""
    port = free_port()
    spy = _Spy(monkeypatch)
    hosted: list[Any] = []
    later = spy.after_ask(lambda: hosted.append(_host(port)), 1.5)
    try:
        client = connect_client(_rank1(port), 30.0, timedelta(seconds=10))
        spy.note("joined")
        client.set("late", "joined")
        later.join()  # the store listens before _host returns it: the client may come first
        assert hosted[0].get("late") == b"joined", spy.times
    finally:
        later.join()
    assert spy.asks >= 2, spy.times
    assert spy.clients == 1


def test_a_store_slow_to_answer_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store busy with thousands of connects (here: its host stopped, so that the kernel
    completes the connect and nothing answers) is waited for within the connect timeout."""
    port = free_port()
    context = mp.get_context("forkserver")  # run_workers' server: torch imported once
    context.set_forkserver_preload(["torch", "torch.distributed"])
    ours, theirs = context.Pipe()
    host = context.Process(target=ranks.host_store, args=(port, theirs), daemon=True)
    host.start()
    assert host.pid is not None
    pid = host.pid
    try:
        assert ours.poll(120) and ours.recv() == "up"
        os.kill(pid, signal.SIGSTOP)
        wait_until_stopped(pid)  # its store's thread could answer until then
        spy = _Spy(monkeypatch)
        threading.Timer(1.5, lambda: os.kill(pid, signal.SIGCONT)).start()
        client = connect_client(_rank1(port), 30.0, timedelta(seconds=10))
        spy.note("joined")
        client.set("slow", "joined")
        assert client.get("slow") == b"joined", spy.times
        assert (spy.asks, spy.clients) == (1, 1), spy.times
    finally:
        os.kill(pid, signal.SIGCONT)
        host.kill()
        host.join()


def test_a_master_that_is_not_there_is_named_quietly_and_leaves_nothing_running() -> None:
    port = free_port()  # nothing listens there
    [seen] = run_workers(ranks.unreachable, 1, port, timeout_s=120)
    assert "cannot reach the rendezvous master at MASTER_ADDR=127.0.0.1" in seen["error"], seen
    assert seen["elapsed"] >= 1.0, seen  # it asked until its connect timeout, not once
    assert seen["stderr"] == "", seen["stderr"][-3000:]
    assert seen["threads_left"] == 0


_ONE_LINE = """
import sys
import ddpkit
from ddpkit.errors import RendezvousError
try:
    ddpkit.init(connect_timeout_s=2.0)
except RendezvousError as exc:
    print(f"ddpkit: error: {exc}", file=sys.stderr)
    sys.exit(3)
"""


@pytest.mark.parametrize("mode", ["close", "silent", "garbage"])
def test_a_master_port_held_by_a_listener_that_is_no_store_prints_one_line(
    tmp_path: Path, mode: str
) -> None:
    """What the user sees is the one-line error: before, a listener that accepts and closes
    had torch's client retry and print 184 lines of C++ traces before it. That case runs as a
    script of its own, to its interpreter's exit; the others in a forked process, the stderr
    of their init() read from its file descriptor."""
    with _squatter(mode) as port:
        env = clean_env(**_launcher_env("torchrun", port))
        if mode == "close":
            run = subprocess.run(
                [sys.executable, "-c", _ONE_LINE],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert run.returncode == 3, run.stderr[-3000:]
            stderr = run.stderr
        else:
            [stderr] = run_workers(ranks.one_line, 1, env, timeout_s=120)
    lines = stderr.splitlines()
    assert len(lines) == 1, f"{len(lines)} lines:\n" + "\n".join(lines[:20])
    assert f"127.0.0.1:{port}" in lines[0] and "does not speak the TCPStore protocol" in lines[0]


# --- the open-files limit, raised for the job's size ------------------------------------


@pytest.mark.multiproc
def test_init_raises_a_low_open_files_limit_to_the_jobs_need() -> None:
    # Before: a soft limit of 1,024 failed jobs of ~500 ranks with EMFILE on the store's host.
    results = run_workers(ranks.limited_rank, 2, 200, 4096, timeout_s=180)
    # rank 0 hosts the store: two accepted connections a rank more than rank 1
    assert [(r["soft"], r["hard"]) for r in results] == [(263, 4096), (259, 4096)]
    assert [r["said"] for r in results] == [[], []]


@pytest.mark.multiproc
def test_a_hard_limit_below_the_need_is_said_once_a_node_and_the_job_goes_on() -> None:
    results = run_workers(ranks.limited_rank, 2, 200, 230, timeout_s=180)
    assert [(r["soft"], r["hard"]) for r in results] == [(230, 230), (230, 230)]
    said = results[0]["said"]
    assert len(said) == 1 and "ulimit -n is 230, and 2 ranks need 263" in said[0], said
    assert results[1]["said"] == []  # local rank 1 of the node, not the store's host


@pytest.mark.multiproc
def test_torchrun_hosting_the_store_without_the_open_files_it_needs_has_rank_0_say_so(
    tmp_path: Path,
) -> None:
    # torchrun's agent hosts the store of every worker of the job (2 connections each) and
    # nobody raises its limit: rank 0, its child, says so with the fix (ddpkit run raises its
    # own: test_ddpkit_run_on_one_node_listens_on_loopback_only_and_has_the_open_files_it_needs).
    # This launch is also init()'s production path under torchrun: env=None, the agent's store,
    # every rank its client, a group that all-reduces.
    from ddpkit.cluster.limits import open_files_needed

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2"]
    rank0, rank1 = _report_of(tmp_path, command, clean_env(), low_open_files=True)
    need = open_files_needed(2, hosts_store=True)
    for rank, seen in enumerate((rank0, rank1)):
        assert (seen["rank"], seen["world"], seen["sum"]) == (rank, 2, 2.0), seen
        assert seen["agent_store"] is True, f"rank {rank} is no client of the agent's store"
    assert rank1["said"] == []
    assert rank0["parent"] == [200, 4096]
    assert len(rank0["said"]) == 1, rank0["said"]
    said = rank0["said"][0]
    assert f"the launcher (pid {rank0['ppid']})" in said and "ulimit -n 200" in said
    assert f"`ulimit -n {need}` before torchrun" in said and "ddpkit run" in said
