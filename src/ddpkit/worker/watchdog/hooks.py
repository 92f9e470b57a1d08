"""Process-wide wiring of the watchdog: one per process, its store connection, a chained
``sys.excepthook``, its exit step, and ``start`` / ``stop`` / ``active`` for ``ddpkit.init()``
and ``shutdown()``. The only module of the watchdog with process-global state, and the only
one that imports torch (when a watchdog starts).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ddpkit.worker import exit as process_exit
from ddpkit.worker.rendezvous.store import store_answers
from ddpkit.worker.steptimes import TIMES
from ddpkit.worker.watchdog.flight import Flight
from ddpkit.worker.watchdog.hang import HangBounds
from ddpkit.worker.watchdog.hangwatch import HangWatch, report_paths, stacks_off, stacks_on_signal
from ddpkit.worker.watchdog.policy import (
    KEY_PREFIX,
    beat_interval_for,
    interval_for,
    op_timeout_for,
)
from ddpkit.worker.watchdog.store import StoreLink
from ddpkit.worker.watchdog.straggler import StragglerWatch
from ddpkit.worker.watchdog.watcher import Watchdog, write_stderr

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

_Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


@dataclass
class _Process:
    active: Watchdog | None = None
    generation: int = 0  # watchdogs started by this process: a fresh key namespace each
    previous_hook: _Hook | None = None


_PROCESS = _Process()


def active() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _PROCESS.active


def _excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    """Chained ``sys.excepthook``: the marker, the usual traceback, then the culprit's name
    (last, where launchers such as ``ddpkit run`` look for the cause)."""
    watchdog, culprit = _PROCESS.active, False
    if watchdog is not None and watchdog.hang_pending() and watchdog.hangs is not None:
        # the error is a hang report's doing (a peer it ended): the watchdog's thread ends
        # this process after the report; wait for it, bounded, and say nothing
        time.sleep(watchdog.hangs.gather_s() + 4 * watchdog.interval_s + 5.0)
    if watchdog is not None:
        with contextlib.suppress(Exception):
            culprit = watchdog.on_uncaught(kind, error)
    (_PROCESS.previous_hook or sys.__excepthook__)(kind, error, tb)
    if culprit and watchdog is not None:
        with contextlib.suppress(Exception):
            write_stderr(watchdog.name_culprit(kind) + "\n")


def _store_of(store: Store) -> Any:
    """The store under ``store``'s prefixes (the group's ``default_pg/``, torchrun's
    ``/worker/attempt_N``): the watchdog's keys sit under its own prefix, naming the attempt."""
    inner: Any = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    return inner


def _store_address(store: Store) -> str:
    inner = _store_of(store)
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    return type(inner).__name__ if host is None or port is None else f"{host}:{port}"


@dataclass
class Connection:
    """The watchdog's own store connection: the store under its prefix, how to end an
    operation in flight at once (shut its socket down), whether the host closed it."""

    store: Any
    cut: Callable[[], None]
    closed: Callable[[], bool]


def own_connection(base: Store, prefix: str, op_timeout_s: float) -> Connection | None:
    """A connection of the watchdog's own to ``base``'s TCPStore, so that its heartbeats are
    never queued behind the program's store calls (a client runs one operation at a time).
    Made once the store answered torch's handshake within ``op_timeout_s`` (torch's client
    has no timeout for it); every operation is bounded by ``op_timeout_s`` through its
    socket's receive and send timeouts (torch's own timeout bounds only waits for a key: an
    ``add`` to a frozen host blocked for good). None when the store is not a TCPStore, the
    connect fails, or its socket cannot be told apart: the exit bound rests on it."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public
    from torch.distributed.distributed_c10d import PrefixStore

    raw = _store_of(base)
    if not isinstance(raw, TCPStore):
        return None
    before = _sockets()
    try:  # a store that answers the handshake: torch's client then neither waits nor prints
        store_answers(raw.host, raw.port, op_timeout_s)
        libuv = bool(getattr(raw, "libuvBackend", True))
        wait = timedelta(seconds=op_timeout_s)
        own = TCPStore(
            raw.host, raw.port, None, False, wait, wait_for_workers=False, use_libuv=libuv
        )
    except Exception:
        return None
    found = [fd for inode, fd in _sockets().items() if inode not in before]
    found = [fd for fd in found if _peer_port(fd) == raw.port]
    if len(found) != 1:
        return None
    (fd,) = found
    timeout = struct.pack("ll", int(op_timeout_s), int(op_timeout_s % 1 * 1e6))
    with _socket(fd) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)

    def cut() -> None:
        with contextlib.suppress(OSError), _socket(fd) as sock:
            sock.shutdown(socket.SHUT_RDWR)

    def closed() -> bool:  # between operations nothing is to be read: readable means closed
        with _socket(fd) as sock:
            try:
                return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True

    return Connection(PrefixStore(prefix, own), cut, closed)  # which keeps ``own`` alive


def _sockets() -> dict[str, int]:
    """This process's sockets: ``socket:[inode]`` -> fd (Linux; empty elsewhere)."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:"):
                    found[target] = int(name)
    return found


@contextlib.contextmanager
def _socket(fd: int) -> Iterator[socket.socket]:
    """A Python socket over ``fd`` that does not close it."""
    sock = socket.socket(fileno=fd)
    try:
        yield sock
    finally:
        sock.detach()


def _peer_port(fd: int) -> int | None:
    with contextlib.suppress(OSError), _socket(fd) as sock:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            return int(sock.getpeername()[1])
    return None


def start(
    *,
    rank: int,
    world_size: int,
    bound_s: float,
    store: Store | None = None,
    clock: Callable[[], float] = time.monotonic,
    hangs: HangBounds | None = None,
    straggler_s: float | None = None,
) -> Watchdog:
    """Start this rank's watchdog on the default group's store (or ``store``); stops one this
    process still runs. Rank 0 hosts the store unless the workers use torchrun's agent store
    (torch reads ``TORCHELASTIC_USE_AGENT_STORE`` from ``os.environ``: so does this)."""
    from ddpkit.compat import default_store

    stop("left the job")
    base = store if store is not None else default_store()
    op_timeout_s = op_timeout_for(bound_s)
    # Restarts of a torchrun job may share one store; so may several init()s of one process.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _PROCESS.generation += 1
    own = own_connection(base, f"{KEY_PREFIX}{attempt}/{_PROCESS.generation}/", op_timeout_s)
    if own is None:  # no bounded operations, no exit bound: no watchdog (init() warns)
        raise RuntimeError(
            f"no connection of its own to the job's store at {_store_address(base)} within "
            f"{op_timeout_s:g} s"
        )
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    link = StoreLink(
        own.store,
        rank=rank,
        world_size=world_size,
        interval_s=interval_for(bound_s),
        bound_s=bound_s,
        host_rank=None if agent else 0,
        address=_store_address(base),
        clock=clock,
        op_timeout_s=op_timeout_s,
        beat_interval_s=beat_interval_for(bound_s, world_size),
        cut=own.cut,
        closed=own.closed,
    )
    watchdog = Watchdog(link, bound_s=bound_s, clock=clock)
    if hangs is not None:
        watchdog.hangs = HangWatch(
            link,
            Flight(),
            hangs,
            main=threading.current_thread(),
            clock=clock,
            interval_s=link.beat_interval_s,  # every rank answers once a beat interval
            report_paths=report_paths(os.environ),
        )
        stacks_on_signal()
    if straggler_s is not None:
        watchdog.stragglers = StragglerWatch(
            link,
            rank=rank,
            world_size=world_size,
            period_s=straggler_s,
            totals=TIMES.totals,
            clock=clock,
        )
    if sys.excepthook is not _excepthook:  # again if someone replaced it (torch's init)
        _PROCESS.previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    process_exit.add(process_exit.MARKER, "the peer watchdog's exit marker", stop)
    watchdog.start()
    _PROCESS.active = watchdog
    return watchdog


def stop(how: str = "exited") -> None:
    """Stop this process's watchdog, if one runs (its exit marker says ``how``). The exit
    path's first step (:mod:`ddpkit.worker.exit`): before the group's sockets close, which is
    what wakes the peers."""
    watchdog, _PROCESS.active = _PROCESS.active, None
    if watchdog is not None:
        stacks_off()
        watchdog.stop(how)
