"""The watchdog's policy, pure: its bound and interval, who left first, and what to say.

No threads, no store, no torch: every decision the watchdog makes about a departure is a
function of values, unit-tested without processes (tests/worker/test_watchdog.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddpkit.cluster.durations import positive_seconds, seconds_from_env
from ddpkit.cluster.envvars import to_float
from ddpkit.contract import DEFAULT_PEER_TIMEOUT_S, PEER_TIMEOUT_VAR

THREAD_NAME = "ddpkit-watchdog"
KEY_PREFIX = "ddpkit/watchdog/"
ABORT_EXIT_CODE = 1
HOOK_POLL_S = 0.05
MAX_OP_TIMEOUT_S = 10.0  # a store operation of the watchdog's is bounded by this, at most
# In the RuntimeErrors a collective raises when a peer is gone (NCCL's are DistErrors).
PEER_FAILURE_TEXTS = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl")
# Heartbeats a second that all ranks together send rank 0's store, at most, once the world is
# large enough (each beat comes with one poll: twice that many store calls a second).
BEATS_PER_S = 512.0
# Beat counters rank 0 reads a second, at most (see judging_parts)
JUDGED_PER_S = 1024.0
# How long, in beat intervals, a counter stands still before rank 0 lists its rank as stale for
# a failed collective's survivors (stale_gap_s): a live rank beats at least twice in it.
STALE_BEATS = 2.2


# --- configuration (pure) -----------------------------------------------------------------------


def peer_timeout(env: Mapping[str, str], explicit_s: float | None) -> float | None:
    """The watchdog's bound in seconds, or None when it is off.

    ``explicit_s`` (``init(peer_timeout_s=)``) wins; else ``DDPKIT_PEER_TIMEOUT`` from ``env``;
    else 60 s. ``0`` (or ``off`` in the variable) turns the watchdog off.
    """
    if explicit_s is not None:
        if explicit_s == 0 and not isinstance(explicit_s, bool):
            return None
        hint = "e.g. peer_timeout_s=120, or 0 for off"
        return positive_seconds(explicit_s, "peer_timeout_s", hint=hint)
    if _is_off(env.get(PEER_TIMEOUT_VAR, "").strip().lower()):
        return None
    hint = f"e.g. {PEER_TIMEOUT_VAR}=120, or {PEER_TIMEOUT_VAR}=off to turn the watchdog off"
    value = seconds_from_env(env, PEER_TIMEOUT_VAR, example="120", hint=hint)
    return DEFAULT_PEER_TIMEOUT_S if value is None else value


def _is_off(raw: str) -> bool:
    """``off``, or a number equal to 0 (``0``, ``0.0``)."""
    return raw == "off" or to_float(raw) == 0


def interval_for(bound_s: float) -> float:
    """How often the watchdog polls and samples: ``min(1 s, bound / 4)``."""
    return min(1.0, bound_s / 4)


def op_timeout_for(bound_s: float) -> float:
    """``T``, the bound on each store operation of the watchdog's: ``min(10 s, bound / 2)``.
    An operation that times out means the store's host is gone (a frozen host is named as
    one that stopped answering within the bound); the exit waits at most ``2 x T`` for the
    watchdog (:mod:`.watcher`), within the bound."""
    return min(MAX_OP_TIMEOUT_S, bound_s / 2)


def beat_interval_for(bound_s: float, world_size: int) -> float:
    """How often a rank other than 0 beats and polls the store: :func:`interval_for`, stretched
    past :data:`BEATS_PER_S` ranks so that the ranks together beat at most that often a second
    (``world_size / BEATS_PER_S`` s: 2 s at 1,024 ranks, 8 s at 4,096), never over a quarter
    of the bound (a live rank beats at least 4 times a bound; past 7,680 ranks at the default
    60 s bound the load grows with the world again).

    Rank 0 keeps :func:`interval_for`: it judges the counters that often, every one up to 1,024
    ranks (a part of them past that, each once a beat interval at least: :func:`judging_parts`),
    so a rank that stops beating is named within the bound + 2 intervals (+ a read period past
    1,024 ranks). What slows with the world is how soon the other ranks read a departure marker
    (once a beat interval) and whether a failed collective's excepthook can name a peer whose
    beats stopped just now (rank 0 lists it only after :func:`stale_gap_s`)."""
    return min(bound_s / 4, max(interval_for(bound_s), world_size / BEATS_PER_S))


def beat_phase(rank: int) -> float:
    """Where in its beat interval a rank other than 0 beats, as a fraction in (0, 1]: its
    watchdog's own connection and first beat come that fraction of an interval after the
    watchdog starts (none at once), every later beat whole intervals after it (``on_grid``).

    Every rank is let go by the same barrier, so without it their beats (and the polls that
    come with them) reach rank 0's store together, once an interval, for as long as the job
    runs: at 4,096 ranks 8,192 calls in one burst every 8 s, which the program's own store
    calls on rank 0 wait behind. The fractions of the golden ratio's multiples spread any
    number of ranks evenly over the interval (no two close, whatever the world size), with no
    randomness: the same rank beats at the same phase in every run. The first gap is shorter
    than an interval, never longer: no rank beats less often than before."""
    return 1.0 - (rank * _GOLDEN) % 1.0


_GOLDEN = 0.6180339887498949  # (sqrt(5) - 1) / 2


def on_grid(due: float, cadence_s: float, now: float) -> float:
    """When a rank beats next, its beat due at ``due`` having come at ``now``: the first of
    ``due + k x cadence_s`` (k >= 1) after ``now``. A rank stays on its phase's grid, however
    late a beat came (a slow connect, a starved thread): anchored to the late beat instead,
    every rank that came late together (the last connects of a start-up's ramp) would beat
    together in every later interval too, a burst at the store that never spreads again. No
    gap between beats is longer than an interval and the lateness."""
    return due + cadence_s * max(1, math.floor((now - due) / cadence_s) + 1)


def judging_parts(world_size: int, interval_s: float, beat_interval_s: float) -> int:
    """In how many parts rank 0 reads the beat counters, a part a round (every ``interval_s``):
    each counter moves once a beat interval, so reading every counter each round read most of
    them for nothing (4,096 keys a second at 4,096 ranks, 98,304 at 98,304). At most
    :data:`JUDGED_PER_S` counters a second, and every counter at least once a beat interval:
    1 part (all each round) to 1,024 ranks, 2 at 2,048, 4 at 4,096, 15 at 98,304 (the beat
    interval's cap at the default bound: 6,554 counters a round, more than 1,024 past ~15,000
    ranks). A rank that stops is named up to a read period (``parts x interval_s``) later than
    the bound + 2 intervals."""
    needed = math.ceil(world_size / JUDGED_PER_S)
    return max(1, min(needed, math.floor(beat_interval_s / interval_s + 1e-9)))


def stale_gap_s(interval_s: float, beat_interval_s: float, parts: int) -> float:
    """How long a counter stands still before rank 0 lists its rank as stale for a failed
    collective's survivors: 2.2 beat intervals, plus ``parts - 1`` rounds. A live rank's
    counter, read once a read period (``parts`` rounds), is seen to move less than a beat
    interval + a read period after it was last seen to (1.2 beat intervals - a round spare)."""
    return STALE_BEATS * beat_interval_s + (parts - 1) * interval_s


def hook_wait_for(interval_s: float) -> float:
    """How long an uncaught peer failure waits for the culprit's marker (>= 2 heartbeats)."""
    return min(2.5, max(2.0, 2.5 * interval_s))


# --- who left, and what to say (pure) -----------------------------------------------------------


@dataclass(frozen=True)
class Departure:
    """A rank (or the store's host) that left. ``victim``: it left because another one did."""

    rank: int | None  # None: the launcher's store, which no rank hosts
    who: str  # "rank 1 on host nodeB (pid 4242)"
    how: str  # "exited", "raised ValueError: bad batch", "stopped sending heartbeats 61 s ago"
    victim: bool = False
    left_at: float = 0.0  # this process's monotonic clock
    node: str | None = None  # SLURM's name for its node, when it ran under SLURM

    def subject(self) -> str:
        return f"{self.who} {self.how}"


def describe_rank(rank: int, host: str | None, pid: int | None) -> str:
    """``rank 1 on host nodeB (pid 4242)``; the unknown parts are left out."""
    text = f"rank {rank}"
    if host:
        text += f" on host {host}"
    if pid is not None:
        text += f" (pid {pid})"
    return text


def read_marker(rank: int, raw: bytes, now: float) -> Departure:
    """The departure a rank's ``exit/<rank>`` marker tells (anyone who reaches the store can
    write one: what does not parse is a rank that left, no more)."""
    try:
        marker = json.loads(raw.decode())
        pid = marker.get("pid")
        return Departure(
            rank,
            describe_rank(rank, str(marker.get("host") or ""), pid),
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
    for departure in others:
        if not departure.victim:
            return departure
    return others[0] if others else None


def _whose_log(cause: Departure) -> str:
    return "the launcher's" if cause.rank is None else f"rank {cause.rank}'s"


def abort_message(cause: Departure, me: int, waited_s: float, bound_s: float) -> str:
    """The line a blocked survivor prints before the watchdog ends it."""
    return (
        f"ddpkit: {cause.subject()} while rank {me} was waiting for it in a collective; "
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
        f"ddpkit: {cause.subject()} while rank {me} was waiting for it in a collective; "
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
