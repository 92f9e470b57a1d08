"""The process's distributed context: ``init()`` joins the job once, ``current()`` returns it.

``init`` latches the stop signal first (:mod:`ddpkit.cluster.stop.latch`), then detects the
launcher, chooses the device, resolves backend and timeouts, reaches the store (every wait
bounded: :mod:`ddpkit.worker.process_group`), joins the group, checks that no two ranks share a
GPU and starts the peer watchdog. It is idempotent, never writes ``os.environ``, adopts a group
someone else created (without a watchdog; the group's rank and world size win) and destroys at
exit only a group it created. The run's identity (:mod:`ddpkit.cluster.runid`) is the same on
every rank: from the environment, else rank 0's fresh id, agreed on at ``init``.

:data:`_STATE` is the one process-wide state. Helpers find it through
:func:`current_or_none`, which also adopts a group made with plain ``torch.distributed``, so no
rank-aware helper acts on numbers the group does not have.
"""

from __future__ import annotations

import multiprocessing
import os
import warnings
import weakref
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ddpkit.cluster.detect import detect
from ddpkit.cluster.devices import choose_device, owned_devices
from ddpkit.cluster.rankinfo import ANY_PORT, RankInfo
from ddpkit.cluster.runid import RunIdentity, run_identity
from ddpkit.cluster.stop import latch
from ddpkit.errors import ConfigError, TopologyError, UsageError
from ddpkit.masking import assignment
from ddpkit.worker import exit as process_exit
from ddpkit.worker import process_group, straggler, watchdog
from ddpkit.worker.watchdog.flight import recording

__all__ = ["Context", "current", "current_or_none", "init", "shutdown"]


@dataclass(frozen=True)
class Context:
    """Who this process is (``info``), which device it computes on, which backend it talks,
    and which run and attempt it belongs to (``run``)."""

    info: RankInfo
    device: torch.device
    backend: str
    run: RunIdentity

    @property
    def run_id(self) -> str:
        """The run's id: the same on every rank and in every attempt (requeue, restart)."""
        return self.run.run_id

    @property
    def attempt(self) -> int:
        """This attempt of the run, from 0 (see :mod:`ddpkit.cluster.runid`)."""
        return self.run.attempt

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that logs, prints and saves)."""
        return self.info.rank == 0

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def local_rank(self) -> int:
        return self.info.local_rank


@dataclass
class _State:
    context: Context | None = None
    group: weakref.ref[object] | None = None  # the default group ``context`` belongs to
    owns_group: bool = False  # True only when ddpkit called init_process_group itself
    # A group adopted by current_or_none(), not remembered as the context: a later init() runs.
    implicit: tuple[weakref.ref[object], Context] | None = None
    warned: set[str] = field(default_factory=set)


_STATE = _State()


def init(
    backend: str = "auto",
    timeout_s: float | None = None,
    *,
    connect_timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    device: str | torch.device | None = None,
    peer_timeout_s: float | None = None,
    hang_timeout_s: float | None = None,
    hang_first_timeout_s: float | None = None,
) -> Context:
    """Join the job (once) and return its :class:`Context`.

    ``backend``: ``"auto"`` (nccl on CUDA, gloo otherwise) or any torch backend string, e.g.
    ``"gloo"`` or ``"cpu:gloo,cuda:nccl"``. ``timeout_s``: the collective timeout, which bounds
    a rank that hangs while alive (None: ``DDPKIT_COLLECTIVE_TIMEOUT`` from ``env``, else
    torch's default, 10-30 min by backend; keep it above the longest wait of your program, e.g.
    ranks waiting at a barrier while rank 0 prepares data). ``connect_timeout_s``: how long
    ranks other than 0 wait for the master to accept connections (None:
    ``DDPKIT_CONNECT_TIMEOUT`` from ``env``, else 60 s + 10 ms a rank after the first).
    ``env``: the variables to detect the launcher from (default ``os.environ``; never
    written). ``device``: overrides the device choice (``cuda:<local_rank>``, ``cuda:0`` when
    each task has GPUs of its own, else cpu).
    ``peer_timeout_s``: the watchdog's bound: when a peer has exited, died or stopped sending
    heartbeats and this rank stays blocked that long, it ends with a line naming the peer
    (None: ``DDPKIT_PEER_TIMEOUT`` from ``env``, else 60 s; 0, or ``off`` in the variable,
    turns the watchdog off; see :mod:`ddpkit.worker.watchdog`). ``hang_timeout_s``: the hang
    watchdog's per-collective bound once the job is past its first step: a rank in one
    collective that long, every rank alive, makes one report naming the stuck rank, and ends
    the job only with ``DDPKIT_HANG_ACTION=end`` (None: ``DDPKIT_HANG_TIMEOUT``, else 180 s,
    grown past 64 ranks; 0 turns it off). ``hang_first_timeout_s``: its bound before the first
    step (None: ``DDPKIT_HANG_FIRST_TIMEOUT``, else 900 s; see
    :mod:`ddpkit.worker.watchdog.hang`). Both need the peer watchdog on.

    On a gloo group of several ranks, ``init`` returns once every rank's group is formed (a
    barrier, the group's first collective): a rank that leaves right after it cannot break a
    slower peer's start with gloo's "Connection closed by peer".

    A second call returns the same context (its arguments are not looked at again). If a
    process group already exists, it is adopted as is; ``shutdown()`` will not destroy it.
    """
    if _STATE.context is not None:
        if _lives(_STATE.group):
            return _STATE.context
        watchdog.stop("destroyed the process group")  # it was destroyed (or replaced) behind us
        _STATE.context, _STATE.group, _STATE.owns_group = None, None, False
    snapshot = dict(os.environ if env is None else env)
    # first: a stop signal sent during start-up (blocked until here) is not lost
    latch.latch_from_env(snapshot)
    adopting = dist.is_initialized()
    info = _detect_for_adoption(snapshot) if adopting else detect(snapshot)
    if not adopting:
        _check_not_spawned_alone(info, snapshot)
    _warn_notes(info.notes)
    run = run_identity(snapshot)  # before joining: a bad DDPKIT_RUN_ID fails before any wait
    if adopting:
        return _remember(_agreed(_adopt(info, device, run)), owns_group=False)
    # a group ddpkit owns; every argument is checked before anything waits
    chosen = _pick_device(info, device)
    resolved = process_group.resolve_backend(backend, chosen.type)
    wait_s = process_group.connect_timeout(snapshot, connect_timeout_s, info.world_size)
    collective_s = process_group.collective_timeout(snapshot, timeout_s)
    bound_s = watchdog.peer_timeout(snapshot, peer_timeout_s)
    hangs = watchdog.hang_bounds(snapshot, hang_timeout_s, hang_first_timeout_s, info.world_size)
    stragglers = straggler.straggler_interval(snapshot)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)  # before joining, so NCCL binds this rank's GPU
    records = hangs is not None and bound_s is not None and info.world_size > 1
    with recording() if records else nullcontext():  # torch's flight recorder: the hang report's
        info = process_group.join(  # where the store actually is (a port search, loopback)
            info,
            backend=resolved,
            device=chosen,
            env=snapshot,
            timeout_s=collective_s,
            connect_timeout_s=wait_s,
        )
    context = _remember(Context(info, chosen, resolved, run), owns_group=True)
    try:
        context = _remember(_agreed(context), owns_group=True)
        if chosen.type == "cuda" and info.world_size > 1:
            # Not exercised by the CPU-only test suite: it needs several GPUs.
            process_group.check_exclusive_gpus(_used_gpus(info, chosen, device))
    except BaseException:
        shutdown()
        raise
    if bound_s is not None and info.world_size > 1:
        _start_watchdog(info, bound_s, hangs, stragglers)
    return context


def _agreed(context: Context) -> Context:
    """``context`` with rank 0's run id when nothing in the environment named the run (each rank
    drew a fresh one): a collective, so only ``init`` (called on every rank) does it."""
    if context.run.source != "fresh" or context.world_size == 1:
        return context
    box = [context.run.run_id]
    dist.broadcast_object_list(box, src=0)
    return replace(context, run=replace(context.run, run_id=str(box[0])))


def _start_watchdog(
    info: RankInfo, bound_s: float, hangs: watchdog.HangBounds | None, stragglers: float | None
) -> None:
    """Start the watchdog and the straggler report; if it cannot start, warn and go on."""
    try:
        dog = watchdog.start(
            rank=info.rank, world_size=info.world_size, bound_s=bound_s, hangs=hangs
        )
        if stragglers is not None:
            straggler.attach(dog, stragglers)
    except Exception as exc:
        warnings.warn(
            f"ddpkit: the peer watchdog could not start ({type(exc).__name__}: {exc}); a rank "
            "that dies will leave the others waiting for the collective timeout",
            RuntimeWarning,
            stacklevel=3,
        )


def current() -> Context:
    """The context of the process group that exists (see :func:`current_or_none`); raises
    :class:`UsageError` when there is none (no ``init()``, no ``torch.distributed`` group)."""
    context = current_or_none()
    if context is None:
        raise UsageError(
            "ddpkit.init() has not been called in this process, and no torch.distributed "
            "process group exists",
            hint="call ctx = ddpkit.init() at the start of the script, before wrap/loader/gather",
        )
    return context


def current_or_none() -> Context | None:
    """The context of the process group that exists, else None (for helpers that work either way):
    ``init()``'s while its group lives, else the plain ``torch.distributed`` group's, adopted
    with its own rank and world size for its lifetime (a later ``init()`` still runs in full).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _STATE.context is not None and _lives(_STATE.group):
        return _STATE.context
    if _STATE.implicit is None or not _lives(_STATE.implicit[0]):
        info = _detect_for_adoption(os.environ)
        _warn_notes(info.notes)
        # no collective here (any rank may ask alone): a fresh run id stays this rank's own
        run = run_identity(os.environ)
        _STATE.implicit = (weakref.ref(dist.group.WORLD), _adopt(info, None, run))
    return _STATE.implicit[1]


def _lives(group: weakref.ref[object] | None) -> bool:
    """True while ``group`` is the default process group (not destroyed, not replaced)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return False
    return group() is dist.group.WORLD


def shutdown() -> None:
    """Stop the watchdog, forget the context, destroy the process group if ddpkit created it.

    Safe to repeat. Peers still in the job see this rank leave ("left the job"); call it
    before long solo work after the others have finished, so no watchdog is left to judge it.
    A DDP model may outlive it: a gloo group it still refers to is kept until the next
    ``init()`` (see :func:`~ddpkit.worker.process_group.destroy`).
    """
    watchdog.stop("left the job (ddpkit.shutdown())")
    owned = _STATE.owns_group and _lives(_STATE.group)  # not a group that replaced ours
    _STATE.context, _STATE.group, _STATE.owns_group = None, None, False
    if owned:
        process_group.destroy()


def _remember(context: Context, *, owns_group: bool) -> Context:
    _STATE.context, _STATE.owns_group = context, owns_group
    _STATE.group = weakref.ref(dist.group.WORLD)
    if owns_group:
        process_exit.add(process_exit.DESTROY, "destroy the process group", _destroy_at_exit)
    return context


def _destroy_at_exit() -> None:
    if _STATE.owns_group:
        shutdown()


def _warn_notes(notes: tuple[str, ...]) -> None:
    for note in notes:
        if note not in _STATE.warned:
            _STATE.warned.add(note)
            warnings.warn(note, RuntimeWarning, stacklevel=3)


def _pick_device(info: RankInfo, override: str | torch.device | None) -> torch.device:
    """The override as given, but a bare ``"cuda"`` means this rank's GPU, as auto would choose
    (``cuda`` alone would put every rank of a node on one GPU)."""
    if override is None:
        return _auto_device(info)
    wanted = torch.device(override)
    if wanted != torch.device("cuda"):  # an index or another type: as given
        return wanted
    chosen = _auto_device(info)
    if chosen.type != "cuda":
        raise ConfigError(
            f"device={str(override)!r} but this process sees no CUDA GPU",
            hint="check CUDA_VISIBLE_DEVICES and the job's GPU request, or pass device='cpu'",
        )
    return chosen


def _auto_device(info: RankInfo) -> torch.device:
    available = torch.cuda.is_available()
    name = choose_device(
        info.local_rank,
        info.local_world_size,
        available,
        torch.cuda.device_count() if available else 0,
        # The CUDA runtime of *this* process obeys os.environ, whatever mapping detection read.
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    return torch.device(name)


def _used_gpus(
    info: RankInfo, chosen: torch.device, override: str | torch.device | None
) -> list[torch.device]:
    """The GPUs this rank uses: its device, or every GPU it sees when they are its own."""
    if override is not None or chosen.index is None:
        return [chosen]
    indexes = owned_devices(
        chosen.index,
        info.local_world_size,
        torch.cuda.device_count(),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    return [torch.device("cuda", index) for index in indexes]


def _check_not_spawned_alone(info: RankInfo, env: Mapping[str, str]) -> None:
    """Refuse a world of one in a process ``mp.spawn`` started with MASTER_ADDR/PORT set (the
    tutorial recipe passes rank and world size as arguments): each would train alone."""
    named = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name in env]
    if info.launcher != "single" or not named or multiprocessing.parent_process() is None:
        return
    raise ConfigError(
        f"{', '.join(assignment(name, env[name]) for name in named)} set in a process started "
        "by multiprocessing (mp.spawn?) but not RANK, WORLD_SIZE: each process would train "
        "alone as rank 0 of 1",
        hint="export RANK and WORLD_SIZE in each process before ddpkit.init() "
        "(os.environ['RANK'] = str(rank), ...), or call torch.distributed.init_process_group("
        "rank=..., world_size=...) first, which ddpkit.init() adopts; a process meant to run "
        "alone: unset them",
    )


def _detect_for_adoption(env: Mapping[str, str]) -> RankInfo:
    """What detection says of this process, for adopting the group that exists; an environment
    detection rejects does not stop it: the record then comes from the group, with a warning."""
    try:
        info = detect(env)
    except (ConfigError, TopologyError) as exc:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        note = (
            f"ddpkit: adopting the existing process group as rank {rank} of {world_size}; "
            f"the environment does not describe this process ({exc.message})"
        )
        info = RankInfo(rank, 0, world_size, 1, rank, world_size, "127.0.0.1", ANY_PORT, "env")
        info = replace(info, notes=(note,))
    return info


def _adopt(info: RankInfo, override: str | torch.device | None, run: RunIdentity) -> Context:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if (rank, world_size) != (info.rank, info.world_size):
        warnings.warn(
            f"adopting the existing process group as rank {rank} of {world_size}, although "
            f"the environment (launcher {info.launcher}) says rank {info.rank} of "
            f"{info.world_size}; the group's numbers win",
            RuntimeWarning,
            stacklevel=3,
        )
        info = replace(info, rank=rank, world_size=world_size)
    return Context(info, _pick_device(info, override), str(dist.get_backend()), run)
