"""The hang watchdog's policy, pure: its two bounds, who is the odd one out, the report.

Every rank alive and heartbeating, one of them stuck (a sleep, another collective, a data
loader worker, a slow filesystem): the peer watchdog sees no departure and torch waits its
10-30 min. The hang watchdog bounds it. A rank that has been inside one collective for longer
than the bound asks every rank, over the store, for its piece: its main thread's stack and its
collectives from torch's flight recorder (:mod:`.flight`: the one in flight, the last completed,
DDP's gradient all-reduces from C++ included); the pieces are grouped by identical stacks and
the rank(s) not where the majority waits are named, in one report. The place a collective is
written at is the main thread's innermost frame of the program (the recorder keeps no stack).

What happens then is ``DDPKIT_HANG_ACTION``'s: ``report`` by default (the report is printed and
kept; the job goes on, and torch's collective timeout ends one that never resumes), ``end`` to
end every rank at the report.

Two bounds, as torchtitan has: until the job is past its first step (a collective made after
``init()`` completed twice alike: :mod:`.flight`) the generous ``DDPKIT_HANG_FIRST_TIMEOUT``
(data preparation on rank 0 while the others wait at a barrier must still work), then
``DDPKIT_HANG_TIMEOUT``, which grows with the world size past 64 ranks
(``bound * log2(world) / 6``: 1.5 x at 512, 2 x at 4096).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit.cluster.durations import positive_seconds, seconds_from_env
from ddpkit.cluster.envvars import to_float
from ddpkit.contract import (
    DEFAULT_HANG_FIRST_TIMEOUT_S,
    DEFAULT_HANG_TIMEOUT_S,
    HANG_ACTION_VAR,
    HANG_ACTIONS,
    HANG_FIRST_TIMEOUT_VAR,
    HANG_TIMEOUT_VAR,
)
from ddpkit.errors import ConfigError

_STACK_FRAMES = 14  # the innermost frames of each stack in the report


@dataclass(frozen=True)
class HangBounds:
    """The bound before the first step and after it (already scaled by the world size)."""

    first_s: float
    step_s: float
    base_step_s: float  # as set, before scaling
    end: bool = False  # DDPKIT_HANG_ACTION=end: every rank ends at the report

    def bound(self, past_first_step: bool) -> float:
        return self.step_s if past_first_step else self.first_s

    def which(self, past_first_step: bool) -> str:
        """``DDPKIT_HANG_TIMEOUT=3`` (x1.5 for 512 ranks), for the report."""
        if not past_first_step:
            return f"{HANG_FIRST_TIMEOUT_VAR}={self.first_s:g}, before the first step"
        scale = self.step_s / self.base_step_s
        scaled = f" x {scale:.2f} for the world size" if scale > 1.0001 else ""
        return f"{HANG_TIMEOUT_VAR}={self.base_step_s:g}{scaled}"


def scaled_for(bound_s: float, world_size: int) -> float:
    """The per-collective bound for ``world_size`` ranks: as set up to 64 ranks, then growing
    with log2 of the world size (stragglers grow with it; collectives' depth too)."""
    return bound_s * max(1.0, math.log2(max(world_size, 1)) / 6)


def hang_bounds(
    env: Mapping[str, str],
    explicit_s: float | None,
    explicit_first_s: float | None,
    world_size: int,
) -> HangBounds | None:
    """The two bounds, or None when the hang watchdog is off.

    ``explicit_s`` (``init(hang_timeout_s=)``) wins over ``DDPKIT_HANG_TIMEOUT``, else 180 s;
    ``0`` (or ``off``) turns it off. ``explicit_first_s`` (``init(hang_first_timeout_s=)``) wins
    over ``DDPKIT_HANG_FIRST_TIMEOUT``, else 900 s, and is never below the other bound.
    """
    step = _resolve(env, explicit_s, HANG_TIMEOUT_VAR, "hang_timeout_s", DEFAULT_HANG_TIMEOUT_S)
    if step is None:
        return None
    first = _resolve(
        env,
        explicit_first_s,
        HANG_FIRST_TIMEOUT_VAR,
        "hang_first_timeout_s",
        DEFAULT_HANG_FIRST_TIMEOUT_S,
        can_be_off=False,
    )
    step_s = scaled_for(step, world_size)
    first_s = max(first or step_s, step_s)
    end = hang_action(env) == "end"
    return HangBounds(first_s=first_s, step_s=step_s, base_step_s=step, end=end)


def hang_action(env: Mapping[str, str]) -> str:
    """``DDPKIT_HANG_ACTION``: ``report`` (the default: the report, and the job goes on) or
    ``end`` (every rank ends at the report). Ending is opt-in: a rank past the bound may be
    slow, not stuck, and a guess from timing never ends a correct program by default."""
    raw = env.get(HANG_ACTION_VAR, "").strip().lower()
    if not raw:
        return HANG_ACTIONS[0]
    if raw not in HANG_ACTIONS:
        raise ConfigError(
            f"{HANG_ACTION_VAR}={env[HANG_ACTION_VAR]!r} is not a hang action",
            hint=f"use {HANG_ACTION_VAR}=report (the default) or {HANG_ACTION_VAR}=end",
        )
    return raw


def _resolve(
    env: Mapping[str, str],
    explicit_s: float | None,
    variable: str,
    keyword: str,
    default_s: float,
    *,
    can_be_off: bool = True,
) -> float | None:
    off = ", or 0 for off" if can_be_off else ""
    if explicit_s is not None:
        if can_be_off and explicit_s == 0 and not isinstance(explicit_s, bool):
            return None
        return positive_seconds(explicit_s, keyword, hint=f"e.g. {keyword}=300{off}")
    raw = env.get(variable, "").strip().lower()
    if can_be_off and (raw == "off" or to_float(raw) == 0):
        return None
    hint = f"e.g. {variable}=300" + (f", or {variable}=off" if can_be_off else "")
    value = seconds_from_env(env, variable, example="300", hint=hint)
    return default_s if value is None else value


# --- the report (pure) --------------------------------------------------------------------------


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0,2,5-7``."""
    ordered = sorted(ranks)
    spans: list[str] = []
    start = prev = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ("rank " if len(ordered) == 1 else "ranks ") + ",".join(spans)


def short_path(path: str) -> str:
    """The last two parts of a path, as the report writes call sites: enough to find the file,
    short enough to read."""
    parts = path.replace("\\", "/").rsplit("/", 2)
    return "/".join(parts[-2:]) if len(parts) > 2 else path


def _where(piece: Mapping[str, Any]) -> str:
    """``train.py:88 `loss.item()``` from the piece's innermost frame of the program."""
    frame = piece.get("at")
    if not frame:
        return "an unknown place"
    code = f" `{frame[3]}`" if frame[3] else ""
    return f"{frame[0]}:{frame[1]}{code}"


def _call_text(call: Mapping[str, Any] | None) -> str:
    if not call:
        return "none"
    number = f" #{call['seq']}" if call.get("seq") is not None else ""
    sizes = f" {call['sizes']}" if call.get("sizes") else ""
    site = f" at {call['site']}" if call.get("site") else ""
    return f"{call['op']}{number}{sizes} on {call['group']}{site}"


def _state(piece: Mapping[str, Any]) -> tuple[str, ...]:
    """What a rank is doing, as a key to group by: the collective it is in, or none."""
    call = piece.get("running")
    if call:
        return ("in", str(call["op"]), str(call.get("seq")), str(call["group"]))
    return ("out",)


def _who(ranks: Sequence[int], pieces: Mapping[int, Mapping[str, Any]]) -> str:
    if len(ranks) == 1:
        piece = pieces[ranks[0]]
        return f"rank {ranks[0]} (host {piece.get('host')}, pid {piece.get('pid')})"
    hosts = sorted({str(pieces[rank].get("host")) for rank in ranks})
    return f"{ranks_text(ranks)} (host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)})"


def _doing(piece: Mapping[str, Any], others: str = "") -> str:
    """What the rank is doing; ``others``: the ranks waiting elsewhere, when this rank is the
    odd one out (then a rank-0-only ``if`` its collective runs under is named)."""
    call = piece.get("running")
    if call:
        doing = f"is in {_call_text(call)} (for {float(call['age_s']):.1f} s)"
        under = piece.get("under")
        if under and others:
            doing += (
                f", called under `if {under['test']}:` ({short_path(str(under['file']))}:"
                f"{under['if_line']}), rank-0-only code that {others}"
            )
        return doing
    last = piece.get("last")
    after = f"; its last collective: {_call_text(last)}" if last else "; no collective yet"
    loader = piece.get("loader")
    waiting = f", waiting for its data loader worker(s) (pids {loader})" if loader else ""
    return f"is in {_where(piece)}, not in a collective{waiting}{after}"


def diagnose(
    pieces: Mapping[int, Mapping[str, Any]], world_size: int
) -> tuple[list[int], list[int], list[int]]:
    """(the odd ranks out, the ranks waiting on them, the ranks that sent no piece).

    The waiters are the largest group of ranks in one and the same collective; every other
    rank that answered is odd. No rank in a collective: nobody waits (none is odd). A tie
    between two collectives: the group holding the lowest rank is taken as the waiters."""
    answered = sorted(pieces)
    silent = [rank for rank in range(world_size) if rank not in pieces]
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank in answered:
        groups.setdefault(_state(pieces[rank]), []).append(rank)
    inside = [(key, ranks) for key, ranks in groups.items() if key[0] == "in"]
    if not inside:
        return [], [], silent

    def likely_waiters(item: tuple[tuple[str, ...], list[int]]) -> tuple[int, bool, int]:
        # on a tie, ranks inside rank-0-only code are the odd ones, not the waiters
        ranks = item[1]
        return len(ranks), not any(pieces[rank].get("under") for rank in ranks), -min(ranks)

    _, waiters = max(inside, key=likely_waiters)
    odd = [rank for rank in answered if rank not in waiters]
    return odd, waiters, silent


def headline(
    pieces: Mapping[int, Mapping[str, Any]], world_size: int, waited_s: float, bound: str
) -> str:
    """The one line that names the stuck rank(s) and where the others wait."""
    odd, waiters, silent = diagnose(pieces, world_size)
    parts = []
    for rank in odd:
        others = f"{ranks_text(waiters)} skip{'s' if len(waiters) == 1 else ''}" if waiters else ""
        parts.append(f"{_who([rank], pieces)} {_doing(pieces[rank], others)}")
    if silent:
        parts.append(
            f"{ranks_text(silent)} did not answer within the gathering time (frozen, or its "
            "threads cannot run: a long call holding the GIL?)"
        )
    if waiters:
        call = pieces[waiters[0]]["running"]
        verb = "waits" if len(waiters) == 1 else "wait"
        parts.append(f"{ranks_text(waiters)} {verb} in {_call_text(call)}")
    if not odd and not silent:
        parts.append("no rank stands out (all in the same place: a deadlock inside the backend?)")
    return f"ddpkit: hang: {'; '.join(parts)} (for {waited_s:.1f} s; bound: {bound})"


def stack_groups(pieces: Mapping[int, Mapping[str, Any]]) -> list[tuple[list[int], list[str]]]:
    """Ranks grouped by identical stacks (innermost frames), largest group last."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank in sorted(pieces):
        stack = tuple(_frame_lines(pieces[rank].get("stack") or []))
        groups.setdefault(stack, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))
    return [(ranks, list(stack)) for stack, ranks in ordered]


def _frame_lines(stack: Sequence[Sequence[Any]]) -> list[str]:
    lines = []
    for filename, line, function, code in list(stack)[-_STACK_FRAMES:]:
        lines.append(f'  File "{filename}", line {line}, in {function}')
        if code:
            lines.append(f"    {code}")
    return lines


def report(
    pieces: Mapping[int, Mapping[str, Any]],
    world_size: int,
    waited_s: float,
    bound: str,
    reporter: int,
    *,
    silent: Mapping[int, str] | None = None,
) -> str:
    """The whole report: the headline, each rank's state, the stacks grouped. ``silent``: what
    was done to get the stacks of a rank that sent no piece (see :mod:`.hangwatch`)."""
    lines = [headline(pieces, world_size, waited_s, bound)]
    lines.append(f"ddpkit: hang report (gathered by rank {reporter}), each rank:")
    for rank in range(world_size):
        piece = pieces.get(rank)
        if piece is None:
            lines.append(f"  rank {rank}: no answer{(silent or {}).get(rank, '')}")
            continue
        tail = ", ".join(_call_text(call) for call in piece.get("tail", [])[-3:])
        lines.append(f"  {_who([rank], pieces)} {_doing(piece)}; before: {tail or 'none'}")
    for ranks, stack in stack_groups(pieces):
        lines.append(f"ddpkit: stack of {ranks_text(ranks)} (main thread, innermost last):")
        lines += stack or ["  (no stack)"]
    return "\n".join(lines)
