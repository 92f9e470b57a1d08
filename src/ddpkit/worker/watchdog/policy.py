"""The peer watchdog's policy, pure (no threads, store or torch): its bound and intervals, who
left, and what to say."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddpkit.cluster.durations import seconds_or_off
from ddpkit.contract import DEFAULT_PEER_TIMEOUT_S, PEER_TIMEOUT_VAR

THREAD_NAME = "ddpkit-watchdog"
KEY_PREFIX = "ddpkit/watchdog/"
ABORT_EXIT_CODE = 1
# In the RuntimeErrors a collective raises when a peer is gone (NCCL's are DistErrors).
PEER_FAILURE_TEXTS = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl")
BEATS_PER_S = 512.0  # heartbeats a second all ranks together send rank 0's store, at most
STALE_BEATS = 2.2  # beat intervals a counter stands still before a survivor takes it for silent


def peer_timeout(env: Mapping[str, str], explicit_s: float | None) -> float | None:
    """The bound in seconds, None when off: ``init(peer_timeout_s=)``, else
    ``DDPKIT_PEER_TIMEOUT``, else 60 s; ``0`` (or ``off`` in the variable) is off."""
    return seconds_or_off(
        env, explicit_s, PEER_TIMEOUT_VAR, "peer_timeout_s", DEFAULT_PEER_TIMEOUT_S, example="120"
    )


def interval_for(bound_s: float) -> float:
    """How often the watchdog samples and judges: ``min(1 s, bound / 4)``."""
    return min(1.0, bound_s / 4)


def op_timeout_for(bound_s: float) -> float:
    """``T``, the bound on each store operation: ``min(10 s, bound / 2)``."""
    return min(10.0, bound_s / 2)


def beat_interval_for(bound_s: float, world_size: int) -> float:
    """How often a rank other than 0 beats and polls: :func:`interval_for`, stretched so that
    all ranks together beat :data:`BEATS_PER_S` times a second at most, never over bound / 4."""
    return min(bound_s / 4, max(interval_for(bound_s), world_size / BEATS_PER_S))


@dataclass(frozen=True)
class Departure:
    """A rank (or the store's host) that left. ``victim``: it left because another one did."""

    rank: int | None  # None: the launcher's store, which no rank hosts
    who: str  # "rank 1 on host nodeB (pid 4242)"
    how: str  # "exited", "raised ValueError: bad batch", "stopped sending heartbeats 61 s ago"
    victim: bool = False
    left_at: float = 0.0  # this process's monotonic clock
    node: str | None = None  # SLURM's name for its node, when it ran under SLURM


def describe_rank(rank: int, host: str | None, pid: int | None) -> str:
    """``rank 1 on host nodeB (pid 4242)``; the unknown parts are left out."""
    host_text = f" on host {host}" if host else ""
    pid_text = f" (pid {pid})" if pid is not None else ""
    return f"rank {rank}{host_text}{pid_text}"


def read_marker(rank: int, raw: bytes, now: float) -> Departure:
    """The departure an ``exit/<rank>`` marker tells. Anyone who reaches the store can write
    one: what does not parse is a rank that left, no more."""
    try:
        marker = json.loads(raw.decode())
        return Departure(
            rank,
            describe_rank(rank, str(marker.get("host") or ""), marker.get("pid")),
            str(marker.get("how") or "left"),
            victim=bool(marker.get("victim", False)),
            left_at=now - float(marker.get("age_s", 0.0)),
            node=str(marker["node"]) if marker.get("node") else None,
        )
    except (ValueError, TypeError, AttributeError):
        return Departure(rank, describe_rank(rank, None, None), "left", left_at=now)


def read_who(raw: bytes) -> tuple[str | None, int | None, str | None]:
    """Host, pid and SLURM node name of a rank's ``who/<rank>`` introduction."""
    try:
        who = json.loads(raw.decode())
        node = who.get("node")
        return str(who["host"]), int(who["pid"]), None if node is None else str(node)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None, None, None


def pick_cause(departures: Sequence[Departure], me: int) -> Departure | None:
    """The departure to name: the first other rank that left on its own, else the first one."""
    others = [d for d in departures if d.rank != me]
    return next((d for d in others if not d.victim), others[0] if others else None)


def _whose_log(cause: Departure) -> str:
    return "the launcher's" if cause.rank is None else f"rank {cause.rank}'s"


def abort_message(cause: Departure, me: int, waited_s: float, bound_s: float) -> str:
    """The line a blocked survivor prints before the watchdog ends it."""
    return (
        f"ddpkit: {cause.who} {cause.how} while rank {me} was waiting for it in a collective; "
        f"ending rank {me} after {waited_s:.1f} s (bound: {PEER_TIMEOUT_VAR}={bound_s:g}) "
        f"(hint: start with {_whose_log(cause)} log; if rank {me} was only busy in one long "
        f"call after its peers had finished, raise {PEER_TIMEOUT_VAR} or call "
        "ddpkit.shutdown() before such solo work)"
    )


def raised_message(cause: Departure | None, me: int, error: str, waited_s: float) -> str:
    """The line the excepthook prints after the traceback of a failed collective."""
    if cause is None:
        return (
            f"ddpkit: rank {me} lost a peer in a collective ({error} above), but no rank "
            f"reported leaving within {waited_s:.1f} s (hint: look for the rank that failed "
            "first in the other ranks' logs or the launcher's report)"
        )
    return (
        f"ddpkit: {cause.who} {cause.how} while rank {me} was waiting for it in a collective; "
        f"rank {me} fails with the {error} above (hint: start with {_whose_log(cause)} log: "
        "every rank must reach the same collectives)"
    )


def looks_like_peer_failure(error: BaseException) -> bool:
    """Whether an exception is what a collective raises when a peer is gone."""
    if any(kind.__name__ == "DistError" for kind in type(error).__mro__):  # torch.distributed's
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(t in text for t in PEER_FAILURE_TEXTS)


def how_it_raised(kind: type[BaseException], error: BaseException) -> str:
    if issubclass(kind, KeyboardInterrupt):
        return "was interrupted (KeyboardInterrupt)"
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if len(first) > 160:
        first = first[:157] + "..."
    return f"raised {kind.__name__}: {first}" if first else f"raised {kind.__name__}"
