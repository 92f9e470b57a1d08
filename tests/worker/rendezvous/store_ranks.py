"""The ranks of tests/worker/rendezvous/test_store.py: what each forked process runs.

A module of their own, without pytest: ``run_workers``' fork server (torch preloaded) imports
the module of the function it runs in every rank it forks, and a test module brings pytest
with it (~0.2 CPU-s a rank on the test machine, more than many of these ranks spend on their
own). The tests' assertions stay in test_store.py.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import ddpkit
import ddpkit.worker.rendezvous.store as store_module
from ddpkit.cluster.rankinfo import RankInfo
from tests.support.distutil import slurm_step_env, torchrun_env
from tests.support.sockets import listening


def as_launched(env: dict[str, str]) -> None:
    """In a forked worker: the environment a launcher would have started it with."""
    os.environ.clear()
    os.environ.update(env)


@contextmanager
def stderr_captured(into: list[str]) -> Iterator[None]:
    """Everything written to file descriptor 2 meanwhile (Python's and torch's C++ alike),
    appended to ``into`` as one text."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            into.append(sink.read().decode(errors="replace"))


def world_of_one(
    rank: int, world_size: int, port: int, env: dict[str, str], backend: str
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ddpkit.compat import default_store

    as_launched(env)
    before = listening()
    ctx = ddpkit.init(backend=backend)
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.barrier()
    store = default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    after = listening()
    ddpkit.shutdown()
    return {
        "before": before,
        "after": after,
        "store": type(store).__name__,
        "world": ctx.world_size,
        "sum": total.item(),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }


def store_listener(rank: int, world_size: int, port: int, kind: str) -> dict[str, Any]:
    env = job_env(kind, rank, world_size, port)
    ctx = ddpkit.init(env=env, connect_timeout_s=60)
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    mine = [pair for pair in listening() if pair[1] == ctx.info.master_port]
    dist.barrier()  # rank 0 keeps the store until every rank has looked
    ddpkit.shutdown()
    return {"addr": ctx.info.master_addr, "listeners": mine, "sum": total.item()}


def job_env(kind: str, rank: int, world_size: int, port: int) -> dict[str, str]:
    host = socket.gethostname()
    if kind == "torchrun-vars":  # the variables of a one-node torchrun, no agent store
        return torchrun_env(rank, world_size, port)
    step = slurm_step_env(rank, world_size, "4242", host)
    if kind == "slurm-one-node":  # MASTER_ADDR names this host, not loopback
        return {**step, "MASTER_ADDR": host, "MASTER_PORT": str(port)}
    assert kind == "slurm-port-search"  # no MASTER_*: rank 0's host from the node list
    return {**step, "SLURM_JOB_ID": str(900000 + port)}  # a whole number, as SLURM sets it


def join(
    rank: int, world_size: int, port: int, cases: list[tuple[dict[str, str], float, float]]
) -> dict[str, Any]:
    """Case ``rank`` of ``cases`` (environment, connect and collective timeouts): init()."""
    from ddpkit.errors import RendezvousError

    env, connect_s, collective_s = cases[rank]
    as_launched(env)
    try:
        ddpkit.init(connect_timeout_s=connect_s, timeout_s=collective_s)
    except RendezvousError as exc:
        return {"error": str(exc)}
    ddpkit.shutdown()
    return {"joined": True}


def late_master(rank: int, world_size: int, port: int, delay_s: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if rank == 0:
        time.sleep(delay_s)
    ddpkit.init(env=torchrun_env(rank, world_size, port), connect_timeout_s=60)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    ddpkit.shutdown()
    return {"sum": total.item()}


def host_store(port: int, up: Any) -> None:
    """A forked process that hosts a store on ``port``, says so on ``up``, and waits."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)
    up.send("up")
    time.sleep(120)
    del store


def unreachable(rank: int, world_size: int, port: int, target: int) -> dict[str, Any]:
    from ddpkit.errors import RendezvousError

    info = RankInfo(1, 1, 2, 2, 0, 1, "127.0.0.1", target, "torchrun")
    before = threading.active_count()
    seen: dict[str, Any] = {}
    stderr: list[str] = []
    started = time.monotonic()
    with stderr_captured(stderr):
        try:
            store_module.connect_client(info, 1.0, timedelta(seconds=5))
        except RendezvousError as exc:
            seen["error"] = str(exc)
    seen["elapsed"] = time.monotonic() - started
    seen["threads_left"] = threading.active_count() - before
    seen["stderr"] = stderr[0]
    return seen


def one_line(rank: int, world_size: int, port: int, env: dict[str, str]) -> str:
    """What test_store's _ONE_LINE writes to stderr up to its exit, in a forked process."""
    from ddpkit.errors import RendezvousError

    as_launched(env)
    stderr: list[str] = []
    with stderr_captured(stderr):
        try:
            ddpkit.init(connect_timeout_s=2.0)
        except RendezvousError as exc:
            print(f"ddpkit: error: {exc}", file=sys.stderr)
        else:
            print("joined", file=sys.stderr)
    return stderr[0]


def limited_rank(rank: int, world_size: int, port: int, soft: int, hard: int) -> dict[str, Any]:
    import resource
    import warnings

    import torch.distributed as dist

    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = ddpkit.init(env=torchrun_env(rank, world_size, port), connect_timeout_s=60)
    dist.barrier()
    now = resource.getrlimit(resource.RLIMIT_NOFILE)
    ddpkit.shutdown()
    said = [str(w.message) for w in caught if "ulimit -n" in str(w.message)]
    return {"rank": ctx.rank, "soft": now[0], "hard": now[1], "said": said}
