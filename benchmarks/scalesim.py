"""Simulated ranks for ``bench_scale.py``: store clients in threads doing a rank's store traffic.

A *rank* here is a thread holding its own store client and doing exactly what a ddpkit rank does
against the rendezvous store, with ddpkit's own code (no copy of it):

* ``ddpkit``: :func:`ddpkit.worker.rendezvous.group.make_store` (rank 0 hosts, the others
  connect, probing the master only when their client lingers, every wait bounded), then the
  group forms, then the watchdog starts as :func:`ddpkit.worker.watchdog.watcher.start` starts it (a
  :class:`~ddpkit.worker.watchdog.store.StoreLink` under a ``PrefixStore`` over a connection
  of its own made in init(), a new client of the same store, whose first step introduces it:
  ``who/<rank>``; rank 0 also creates every ``beat/<rank>`` key), left running to measure its
  heartbeats. Ready: where ``init()``
  returns, the link's thread started. The watchdog is *up* once the link has introduced
  itself, a figure of its own (``init()`` does not wait for it).
* ``ddpkit-rendezvous``: the same with the watchdog off (``DDPKIT_PEER_TIMEOUT=off``): ready
  once the group formed; the part of ddpkit's cost that plain torch's rendezvous does too.
* ``plain``: what ``init_process_group("env://")`` does: torch's ``TCPStore(addr, port,
  world_size, is_master=rank == 0)`` (rank 0 hosts and waits in its constructor until every
  client has checked in), then the group forms. Ready: where ``init_process_group`` returns.

The group forms the same way in both (a store barrier: an ``add``, one ``wait``, uncounted):
``init_process_group`` returns on no rank before every rank has joined (gloo's address exchange
and full-mesh connect, NCCL's unique id through the store), with or without ddpkit, so both
variants pay the release of every waiting rank. What the backend does through the store beyond
that is the same on both sides and is not simulated; nor is the watchdog's judging thread
(``init()`` starts it too; it never touches the store) or the run-id broadcast ``init()`` makes
only when neither SLURM, torchrun nor the user named the run (one small collective, not a store
call). Every store call a rank makes from Python
goes through :class:`Counting` (the calls and the keys they name); each TCP connection to the
store is counted apart (torch's client handshake, a validate and a ping, plus an ``add`` of its
check-in key when given the world size, as plain torch's are and ddpkit's are not, happens
inside its constructor, out of Python's sight).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

import ddpkit.worker.rendezvous.store as store_module
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.cluster.rendezvous.lookup import name_lookups_s
from ddpkit.worker.rendezvous.group import make_store
from ddpkit.worker.watchdog.policy import (
    KEY_PREFIX,
    beat_interval_for,
    interval_for,
    op_timeout_for,
)
from ddpkit.worker.watchdog.store import StoreLink

# When the resolver cannot answer at once (see resolver_answers), each wait of it is 1 s at most.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

# torch's client looks up the name of its socket's address when a process first connects
# (socket.cpp: "The hostname of the client socket cannot be retrieved"), and keeps the answer:
# the 16 ranks of a simulated process connect at once, so each asks. On 127.0.0.1 that address
# is the mapped form, which the hosts file's "127.0.0.1" line does not match: it goes to DNS.
MAPPED_LOOPBACK = "::ffff:127.0.0.1"
SLOW_LOOKUP_S = 0.2
_PRIVATE_HOSTS = "DDPKIT_BENCH_PRIVATE_HOSTS"  # set in the re-run: the hosts file it mounts


def resolver_answers() -> str:
    """Make sure torch's lookup of ``::ffff:127.0.0.1`` is answered at once, as a
    cluster's resolver answers it, and say how; call first thing in ``main()``.

    This sandbox's nameserver answers a few lookups and drops the rest when many come at once:
    each dropped one waits for the resolver's timeout (32 clients made at once in one process
    waited a median 5 s, 64 a median 10 s; 4 ms with the line below). Every column of the scale
    figures sat on a 1 s floor from 128 ranks (RES_OPTIONS timeout:1), the same for every
    variant but not the control plane, and a process's lookups queue behind one another: the
    likeliest cause of the watchdog's outliers of 5-13 s at 4,096 ranks (one connect more a
    rank). So when they are slow, the benchmark runs itself again (root, ``unshare``) in a mount
    namespace of its own, where ``/etc/hosts`` is a copy holding one more line,
    ``::ffff:127.0.0.1 localhost``; the real file is not touched. Where it cannot, the figures
    carry the stalls, and the line it returns says so.
    """
    took = name_lookups_s(MAPPED_LOOPBACK, 64, 3.0)  # one alone is answered here, 64 dropped
    mounted = os.environ.pop(_PRIVATE_HOSTS, None)
    if mounted:
        Path(mounted).unlink(missing_ok=True)  # the mount holds it now
    if took < SLOW_LOOKUP_S:
        how = "a hosts file of its own" if mounted else "this machine's resolver"
        return f"resolver: 64 lookups of {MAPPED_LOOPBACK} at once in {1e3 * took:.1f} ms ({how})"
    if mounted or os.geteuid() != 0 or shutil.which("unshare") is None:
        return (
            f"resolver: WARNING: 64 lookups of {MAPPED_LOOPBACK} at once took {took:.1f} s or "
            "more: torch's client connects here wait for them, and the figures carry it"
        )
    fd, hosts = tempfile.mkstemp(prefix="ddpkit-bench-hosts-")
    with os.fdopen(fd, "w") as out:
        out.write(Path("/etc/hosts").read_text() + f"\n{MAPPED_LOOPBACK} localhost\n")
    os.environ[_PRIVATE_HOSTS] = hosts
    mount = 'mount --bind "$0" /etc/hosts && exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, hosts]
    os.execvp("unshare", [*argv, sys.executable, *sys.argv])


TIMEOUT = timedelta(seconds=600)
OPS = ("set", "get", "add", "check", "multi_get", "append", "wait", "compare_set", "multi_set")


class Tally:
    """Store calls, keys named and connections, of every simulated rank of this process."""

    def __init__(self, *, timed: bool = False) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.keys = 0
        self.connections = 0
        # calls per SLOT_S slot of the (machine-wide) monotonic clock, when they reached the
        # store: kept by the process's tally only (a rank's own is never read for it)
        self.timed = timed
        self.slots: Counter[int] = Counter()

    def add(self, op: str, keys: int) -> None:
        slot = int(time.monotonic() / SLOT_S) if self.timed else None
        with self.lock:
            self.calls[op] += 1
            self.keys += keys
            if slot is not None:
                self.slots[slot] += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"calls": dict(self.calls), "keys": self.keys, "connections": self.connections,
                    "slots": dict(self.slots)}  # fmt: skip


SLOT_S = 0.1  # the slot of Tally.slots: how finely a burst of calls at the store is seen


TALLY = Tally(timed=True)


class Counting:
    """A store whose every call is counted in :data:`TALLY` (the watchdog's ``KeyValue``)."""

    def __init__(self, inner: Any, mine: Tally) -> None:
        self._inner, self._mine = inner, mine

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in OPS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else None
            keys = len(first) if isinstance(first, list) else 1
            TALLY.add(name, keys)
            self._mine.add(name, keys)
            return attr(*args, **kwargs)

        return counted


def _counted_tcpstore(*args: Any, **kwargs: Any) -> TCPStore:
    with TALLY.lock:
        TALLY.connections += 1
    return TCPStore(*args, **kwargs)


def instrument() -> None:
    """Count the store clients ddpkit's rendezvous code makes."""
    store_module.TCPStore = _counted_tcpstore  # type: ignore[misc]


def rank_info(rank: int, world: int, port: int) -> RankInfo:
    return RankInfo(rank, rank, world, world, 0, 1, "127.0.0.1", port, "env")


@dataclasses.dataclass
class Rank:
    """One simulated rank: its stores, its watchdog link, when it was ready."""

    rank: int
    world: int
    port: int
    variant: str
    bound_s: float = 60.0
    ready_at: float | None = None  # where init() / init_process_group returns
    up_at: float | None = None  # ddpkit: its watchdog has introduced itself
    error: str | None = None
    store: Any = None
    link: Driven | None = None
    tally: Tally = dataclasses.field(default_factory=Tally)
    setup_calls: int = 0  # this rank's store calls until it was ready
    # when each step of a rank's start-up ended (monotonic; scale_phases.py reads them), and
    # the CPU time of the thread that did it then (its thread_time: the rank's own thread, the
    # watchdog link's for "linked", "cloned" and "introduced")
    stamps: dict[str, float] = dataclasses.field(default_factory=dict)
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    readied: threading.Event = dataclasses.field(default_factory=threading.Event)  # or failed

    def stamp(self, step: str) -> float:
        self.cpu[step] = time.thread_time()
        self.stamps[step] = now = time.monotonic()
        return now

    def timeline(self) -> dict[str, float]:
        """Both kinds of stamp in one mapping (CPU ones as ``cpu:<step>``), for scale_phases."""
        return {**self.stamps, **{f"cpu:{step}": cpu for step, cpu in self.cpu.items()}}

    def run(self) -> None:
        try:
            if self.variant == "plain":
                self._plain()
            else:
                self._ddpkit(watchdog=self.variant == "ddpkit")
        except Exception as exc:  # reported by the caller with the rank
            self.error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        finally:
            self.readied.set()

    def _plain(self) -> None:
        self.stamp("start")
        self.store = _counted_tcpstore("127.0.0.1", self.port, self.world, self.rank == 0, TIMEOUT)
        self.stamp("connected")
        self._group_formed()
        self.stamp("formed")
        self.ready_at = self.stamp("ready")
        self.readied.set()

    def _group_formed(self) -> None:
        """Until every rank has joined (``init_process_group`` returns on no rank before): one
        ``add``, one ``wait``, uncounted, the same for every variant."""
        if int(self.store.add("sim/joined", 1)) == self.world:
            self.store.set("sim/formed", "1")
        self.store.wait(["sim/formed"], TIMEOUT)

    def _ddpkit(self, *, watchdog: bool) -> None:
        info = rank_info(self.rank, self.world, self.port)
        self.stamp("start")
        self.store, _ = make_store(info, {}, 600.0, TIMEOUT)
        self.stamp("connected")
        self._group_formed()
        self.stamp("formed")
        if not watchdog:  # DDPKIT_PEER_TIMEOUT=off: init() returns once the group formed
            self.ready_at = self.stamp("ready")
            self.readied.set()
            return
        up = _Up(self)
        prefix = f"{KEY_PREFIX}0/1/"
        op_timeout_s = op_timeout_for(self.bound_s)
        # as watcher.start: a connection of its own, made in init() (a new client of the same
        # store; the socket timeouts own_connection sets are left out: it tells the socket
        # apart by its port, which thousands of ranks in one process share), counted
        self.stamp("linked")
        with TALLY.lock:
            TALLY.connections += 1  # the watchdog's: a connection of its own
        own = TCPStore("127.0.0.1", self.port, None, False, timedelta(seconds=op_timeout_s),
                       wait_for_workers=False)  # fmt: skip
        up.part("cloned")
        self.link = Driven(
            StoreLink(
                _Introduced(Counting(PrefixStore(prefix, own), self.tally), up),
                rank=self.rank,
                world_size=self.world,
                interval_s=interval_for(self.bound_s),
                bound_s=self.bound_s,
                host_rank=0,
                address=f"127.0.0.1:{self.port}",
                clock=time.monotonic,
                op_timeout_s=op_timeout_s,
                beat_interval_s=beat_interval_for(self.bound_s, self.world),  # as watcher.start
            )
        )
        self.link.start()  # its first step introduces it (rank 0: and every beat key)
        self.ready_at = self.stamp("ready")  # init() returns here
        self.readied.set()
        if not up.done.wait(600):
            raise TimeoutError("the watchdog link was not up (connected, introduced) in 600 s")
        self.up_at = max(self.stamps["cloned"], self.stamps["introduced"])


class Driven:
    """A simulated rank's link, driven as the watchdog's one thread drives it (its store work,
    ``StoreLink.step``, each time it is due; the judging is not simulated)."""

    def __init__(self, link: StoreLink) -> None:
        self.link, self._stop = link, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.link, name)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            due = self.link.step(now)
            self._stop.wait(max(0.0, min(due, now + 0.05) - time.monotonic()))

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait_s: float | None = None) -> None:
        self.link.stopping = True
        self._stop.set()
        self._thread.join(wait_s)


class _Up:
    """A simulated rank's watchdog is up once it has its own connection ("cloned") and has
    introduced itself ("introduced"), in either order (rank 0: its connection, then every beat
    key; the others: the introduction at start, the connection at their first beat's phase).
    The rank's store calls are counted then, on the thread that did the later part, before any
    beat."""

    def __init__(self, sim: Rank) -> None:
        self.sim, self.done, self._lock, self._parts = sim, threading.Event(), threading.Lock(), 0

    def part(self, step: str) -> None:
        self.sim.stamp(step)
        with self._lock:
            self._parts += 1
            if self._parts == 2:
                self.sim.setup_calls = sum(self.sim.tally.snapshot()["calls"].values())
                self.done.set()


class _Introduced:
    """Tells ``up`` when the link's introduction is over (``who/<rank>``; rank 0: then every
    beat key, in one ``multi_set``), so readiness is timed without touching the link's code."""

    def __init__(self, inner: Counting, up: _Up) -> None:
        self._inner, self._up = inner, up
        self._host = up.sim.rank == 0  # rank 0 creates every beat key after its who/

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def set(self, key: str, value: str) -> None:
        self._inner.set(key, value)
        if key.startswith("who/") and not self._host:
            self._up.part("introduced")

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._inner.multi_set(keys, values)
        if self._host and keys and keys[0].startswith("beat/"):
            self._up.part("introduced")


def context() -> Any:
    """Processes for simulated ranks, forked from a server that imported torch once: a spawned
    interpreter spends ~1 s of CPU importing it, and a job of 4,096 ranks takes 256 of them.
    Each child still gets its parent's ``sys.path`` and main module, as a spawned one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "scalesim"])
    return ctx


def raise_fd_limit() -> None:
    """This process's open-files limit up to its hard limit (thousands of store connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def loaded(
    ranks: list[int], world: int, port: int, variant: str
) -> tuple[list[Rank], list[threading.Thread], threading.Event]:
    """A process's simulated ranks, every one's thread held at the line (:func:`held`), after
    what every such process does first: the open-files limit raised, small thread stacks,
    torch's client counted (:func:`instrument`)."""
    raise_fd_limit()
    threading.stack_size(256 * 1024)
    instrument()
    sims = [Rank(rank, world, port, variant) for rank in ranks]
    threads, line = held(sims)
    return sims, threads, line


def chunks(world: int, procs: int) -> list[list[int]]:
    """Ranks 1 to ``world - 1`` dealt over ``procs`` processes (rank 0 runs in the caller's)."""
    others = list(range(1, world))
    return [others[i::procs] for i in range(procs) if others[i::procs]]


def held(sims: list[Rank]) -> tuple[list[threading.Thread], threading.Event]:
    """Every simulated rank's thread, started and held at the line until the event is set.

    A thread started at the let-go would first wait for its turn at its process's GIL to
    begin at all (``Thread.start`` waits for the new thread to run), behind the ranks started
    before it: the later ranks of a process then began up to a second late in a job of 2,048
    (ddpkit's ranks run Python from their first step, torch's go straight into C++), a delay
    of the simulation's shared interpreters, not of a rank, which starts in its own process.
    """
    line = threading.Event()

    def at_the_line(sim: Rank) -> None:
        line.wait()
        sim.run()

    threads = [threading.Thread(target=at_the_line, args=(sim,), daemon=True) for sim in sims]
    for thread in threads:
        thread.start()
    return threads, line


def store_threads_cpu() -> dict[int, float]:
    """CPU seconds spent so far by each store server thread of this process (torch's libuv
    loop, ``pt_tcpstore_uv``: the one resource every rank of a job shares), by thread id."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="ascii") as comm:
                if comm.read().strip() != "pt_tcpstore_uv":
                    continue
            found[int(tid)] = time.clock_gettime((~int(tid) << 3) | 6)  # that thread's clock
        except OSError:  # the thread ended
            continue
    return found


def store_cpu_since(before: dict[int, float]) -> float:
    """CPU seconds the store threads spent since ``before`` (one started since, all of it: the
    server's loop thread may start just after its socket listens)."""
    return sum(cpu - before.get(tid, 0.0) for tid, cpu in store_threads_cpu().items())


def listen_overflows() -> int:
    """Connects this machine's kernel dropped so far because a listen queue was full
    (``TcpExt: ListenOverflows``): the store's queue overflows when a job's ranks connect at
    once faster than its loop accepts."""
    with open("/proc/net/netstat", encoding="ascii") as stats:
        lines = stats.read().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split(), values.split(), strict=True))["ListenOverflows"])
    raise RuntimeError("/proc/net/netstat has no TcpExt ListenOverflows")


def wait_listening(port: int, timeout_s: float = 60.0) -> None:
    """Until the store on ``port`` accepts connections (the host is up before ranks are let go,
    so that the clients' connect retries and back-off are not what is timed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                what = f"nothing listens on 127.0.0.1:{port} after {timeout_s:g} s"
                raise TimeoutError(what) from exc
        time.sleep(0.01)


def listen_port() -> int:
    """A free port on loopback for the store."""
    from ddpkit.cluster.rendezvous.ports import free_port

    return free_port()


def stop_links(ranks: list[Rank], wait_s: float = 5.0) -> None:
    for rank in ranks:
        if rank.link is not None:
            rank.link.stop(wait_s=0)
    deadline = time.monotonic() + wait_s
    for rank in ranks:
        if rank.link is not None:
            rank.link.stop(wait_s=max(0.0, deadline - time.monotonic()))
