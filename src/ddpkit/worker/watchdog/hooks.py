"""Process-wide wiring of the watchdog: one per process, a chained ``sys.excepthook``, an
atexit marker, and ``start`` / ``stop`` / ``active`` for ``ddpkit.init()`` and ``shutdown()``.

The only module of the watchdog with process-global state and the only one importing torch
(when a watchdog starts: its store thread opens a connection of its own to the default
group's store, see :mod:`ddpkit.compat`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from ddpkit.worker.steptimes import TIMES
from ddpkit.worker.watchdog.flight import Flight
from ddpkit.worker.watchdog.hang import HangBounds
from ddpkit.worker.watchdog.hangwatch import HangWatch, report_paths, stacks_off, stacks_on_signal
from ddpkit.worker.watchdog.policy import (
    HOOK_POLL_S,
    KEY_PREFIX,
    beat_interval_for,
    interval_for,
)
from ddpkit.worker.watchdog.store import DEFAULT_OP_TIMEOUT_S, KeyValue, StoreLink
from ddpkit.worker.watchdog.straggler import StragglerWatch
from ddpkit.worker.watchdog.watcher import Watchdog, write_stderr

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

# --- process-wide wiring ------------------------------------------------------------------------

_Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


@dataclass
class _Process:
    active: Watchdog | None = None
    generation: int = 0  # watchdogs started by this process: a fresh key namespace each
    previous_hook: _Hook | None = None
    atexit_registered: bool = False


_PROCESS = _Process()


def active() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _PROCESS.active


def _excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    """Chained ``sys.excepthook``: the marker, the usual traceback, then the culprit's name
    (last, where launchers such as ``ddpkit run`` look for the cause)."""
    watchdog, culprit = _PROCESS.active, False
    if watchdog is not None and _hang_ends_it(watchdog):
        return
    if watchdog is not None:
        try:
            culprit = watchdog.on_uncaught(kind, error)
        except Exception:
            culprit = False
    (_PROCESS.previous_hook or sys.__excepthook__)(kind, error, tb)
    if culprit and watchdog is not None:
        with contextlib.suppress(Exception):
            write_stderr(watchdog.name_culprit(kind) + "\n")


def _hang_ends_it(watchdog: Watchdog) -> bool:
    """A hang report is being made: the error is its doing (a peer it ended); wait, bounded,
    for the watchdog thread to end this process after the report, and say nothing."""
    if not watchdog.hang_pending() or watchdog.hangs is None:
        return False
    deadline = time.monotonic() + watchdog.hangs.gather_s() + 4 * watchdog.interval_s + 5.0
    while time.monotonic() < deadline:
        time.sleep(HOOK_POLL_S)
    return False


def _at_exit() -> None:
    """Registered after ddpkit's group destroyer, so it runs first: the marker precedes the
    closing of the group's sockets, which is what wakes the peers."""
    watchdog = _PROCESS.active
    if watchdog is not None:
        watchdog.stop("exited")


def _wire_process() -> None:
    """Chain the excepthook (again if someone replaced it, e.g. torch's init_process_group)
    and register the atexit handler, once."""
    if sys.excepthook is not _excepthook:
        _PROCESS.previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    if not _PROCESS.atexit_registered:
        atexit.register(_at_exit)
        _PROCESS.atexit_registered = True


def _raw_store(store: Store) -> Store:
    """The store under ``store``'s prefixes (the group's ``default_pg/``, torchrun's
    ``/worker/attempt_N``): the watchdog's keys sit under its own prefix, which names the
    attempt, on its own connection and on the shared one alike."""
    inner: Any = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    return cast("Store", inner)


def _store_address(store: Store) -> str:
    inner = _raw_store(store)
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if host is None or port is None:
        return type(inner).__name__
    return f"{host}:{port}"


def connect_timeout_s(raw: Store, op_timeout_s: float) -> float:
    """The bound on each try of the watchdog's own connect: half an operation's, or the
    store's own timeout when shorter. Not the store's own (what ``clone()`` takes): torch tries
    about twice, so a try at a host that is gone ends after ~2x its timeout (measured: 1 s ->
    1.5 s, 5 s -> 9 s idle; 11.5 s -> past 28 s beside the CI's SLURM tests), and a try still
    running when the exit stops waiting comes back as the interpreter finalizes and aborts the
    process (StoreLink.stop). Bounded so, a try ends within the exit's usual wait (two
    operations' timeouts) with room to spare, and none begins once the rank leaves."""
    timeout = getattr(raw, "timeout", None)
    own_s = timeout.total_seconds() if isinstance(timeout, timedelta) else op_timeout_s
    return max(0.1, min(own_s, op_timeout_s / 2))


def own_connection(
    base: Store, prefix: str, op_timeout_s: float, *, leaving: Callable[[], bool] = lambda: False
) -> Callable[[], KeyValue | None]:
    """What the watchdog's store thread calls first: a connection of its own to ``base``'s
    store, so that its heartbeats are never queued behind the program's store calls (a
    TCPStore client runs one operation at a time: a ``wait`` in the training script would hold
    every beat), each operation bounded by ``op_timeout_s``. A TCPStore's is a new client of
    the same address, tried (each try bounded by :func:`connect_timeout_s`) until the store's
    own timeout has passed or the rank is ``leaving``: a try can fail on a live store (one name
    lookup the resolver drops takes 5 s). Another store's is a ``clone()``. None (keep
    ``base``, bounded by the group's own timeout) when there is none. The keys are
    ``prefix``'s on the store under ``base``'s prefixes (:func:`_raw_store`)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public
    from torch.distributed.distributed_c10d import PrefixStore

    raw = _raw_store(base)
    try_s = connect_timeout_s(raw, op_timeout_s)
    timeout = getattr(raw, "timeout", None)
    budget_s = timeout.total_seconds() if isinstance(timeout, timedelta) else try_s
    make: Callable[[], Store] | None = getattr(raw, "clone", None)
    if isinstance(raw, TCPStore):

        def make() -> Store:
            return TCPStore(
                raw.host, raw.port, None, False, timedelta(seconds=try_s),
                wait_for_workers=False, use_libuv=bool(getattr(raw, "libuvBackend", True)),
            )  # fmt: skip

    def connect() -> KeyValue | None:
        if make is None:
            return None
        deadline = time.monotonic() + budget_s
        while True:
            try:
                own = make()
                own.set_timeout(timedelta(seconds=op_timeout_s))
                return cast(KeyValue, PrefixStore(prefix, own))
            except Exception:  # the shared connection still works: the group's own timeout then
                left_s = deadline - time.monotonic()
                if not isinstance(raw, TCPStore) or left_s <= 0 or leaving():
                    return None
                time.sleep(min(0.5, left_s))
                if leaving():
                    return None

    return connect


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
    """Start this rank's watchdog on the default group's store (or ``store``).

    Rank 0 hosts the store unless the workers use torchrun's agent store (torch decides that
    from ``TORCHELASTIC_USE_AGENT_STORE`` in ``os.environ``, so this reads it there too). Stops
    a watchdog this process still runs.
    """
    from torch.distributed.distributed_c10d import PrefixStore

    from ddpkit.compat import default_store

    stop("left the job")
    base = store if store is not None else default_store()
    missing = [name for name in ("append", "multi_get", "check") if not hasattr(base, name)]
    if missing:
        raise RuntimeError(f"the store ({type(base).__name__}) lacks {', '.join(missing)}")
    op_timeout_s = max(DEFAULT_OP_TIMEOUT_S, 4 * interval_for(bound_s))
    host_rank = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) else 0
    # Restarts of a torchrun job may share one store; so may several init()s of one process.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _PROCESS.generation += 1
    prefix = f"{KEY_PREFIX}{attempt}/{_PROCESS.generation}/"
    link = StoreLink(
        cast(KeyValue, PrefixStore(prefix, _raw_store(base))),
        rank=rank,
        world_size=world_size,
        interval_s=interval_for(bound_s),
        bound_s=bound_s,
        host_rank=host_rank,
        address=_store_address(base),
        clock=clock,
        op_timeout_s=op_timeout_s,
        beat_interval_s=beat_interval_for(bound_s, world_size),
        connect=own_connection(base, prefix, op_timeout_s, leaving=lambda: link.leaving),
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
            link.call, lambda: link.kv, rank=rank, world_size=world_size, period_s=straggler_s,
            totals=TIMES.totals, clock=clock,
        )  # fmt: skip
    _wire_process()
    watchdog.start()
    _PROCESS.active = watchdog
    return watchdog


def stop(how: str = "exited") -> None:
    """Stop this process's watchdog, if one runs (its exit marker says ``how``)."""
    watchdog, _PROCESS.active = _PROCESS.active, None
    if watchdog is not None:
        stacks_off()
        watchdog.stop(how)
