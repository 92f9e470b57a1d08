"""The hang watchdog's policy, pure: its two bounds, who is the odd one out, the report.

Every rank sends its piece (:mod:`.hangwatch`); the rank(s) not where the majority waits are
named. A rank-0-only ``if`` (``if ctx.is_main: save()`` where ``save`` calls a barrier: the
classic hang) is guessed from source text at report time: the innermost ``if`` without ``else``
whose test holds on rank 0 only and whose body holds the frame that called the collective.
"""

from __future__ import annotations

import ast
import functools
import linecache
import math
import os
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit import contract
from ddpkit.cluster.durations import seconds_or_off
from ddpkit.errors import ConfigError

Pieces = Mapping[int, Mapping[str, Any]]  # rank -> its answer (:meth:`.HangWatch.piece`)
_STACK_FRAMES = 14  # the innermost frames of each stack in the report
_MAX_FRAMES = 8  # program frames looked at for a rank-0-only if
_RANK_ZERO_FLAGS = ("is_main", "is_main_process", "is_global_zero", "is_rank_zero", "is_master")
_RANK_NAMES = ("rank", "global_rank", "get_rank", "get_global_rank", "process_index")


@dataclass(frozen=True)
class HangBounds:
    """The bound before the first step (rank 0 preparing data while the others wait must still
    work) and after it, scaled by the world size."""

    first_s: float
    step_s: float
    base_step_s: float  # as set, before scaling
    end: bool = False  # DDPKIT_HANG_ACTION=end: every rank ends at the report

    def bound(self, past_first_step: bool) -> float:
        return self.step_s if past_first_step else self.first_s

    def which(self, past_first_step: bool) -> str:
        """``DDPKIT_HANG_TIMEOUT=3 x 1.50 for the world size``, for the report."""
        if not past_first_step:
            return f"{contract.HANG_FIRST_TIMEOUT_VAR}={self.first_s:g}, before the first step"
        scale = self.step_s / self.base_step_s
        scaled = f" x {scale:.2f} for the world size" if scale > 1.0001 else ""
        return f"{contract.HANG_TIMEOUT_VAR}={self.base_step_s:g}{scaled}"


def scaled_for(bound_s: float, world_size: int) -> float:
    """As set up to 64 ranks, then growing with log2 of the world size (collectives' depth)."""
    return bound_s * max(1.0, math.log2(max(world_size, 1)) / 6)


def hang_bounds(
    env: Mapping[str, str],
    explicit_s: float | None,
    explicit_first_s: float | None,
    world_size: int,
) -> HangBounds | None:
    """The two bounds, None when the hang watchdog is off: ``init(hang_timeout_s=)`` or
    ``DDPKIT_HANG_TIMEOUT`` (``0``/``off``: off), ``init(hang_first_timeout_s=)`` or
    ``DDPKIT_HANG_FIRST_TIMEOUT`` (never below the other)."""
    var, default = contract.HANG_TIMEOUT_VAR, contract.DEFAULT_HANG_TIMEOUT_S
    step = seconds_or_off(env, explicit_s, var, "hang_timeout_s", default, example="300")
    if step is None:
        return None
    var, default = contract.HANG_FIRST_TIMEOUT_VAR, contract.DEFAULT_HANG_FIRST_TIMEOUT_S
    first = seconds_or_off(
        env, explicit_first_s, var, "hang_first_timeout_s", default, example="300", can_be_off=False
    )
    step_s = scaled_for(step, world_size)
    end = hang_action(env) == "end"
    return HangBounds(max(first or step_s, step_s), step_s, base_step_s=step, end=end)


def hang_action(env: Mapping[str, str]) -> str:
    """``DDPKIT_HANG_ACTION``: ``report`` (the default) or ``end``, opt-in: a rank past the
    bound may be slow, not stuck."""
    var = contract.HANG_ACTION_VAR
    raw = env.get(var, "").strip().lower()
    if raw and raw not in contract.HANG_ACTIONS:
        hint = f"use {var}=report (the default) or {var}=end"
        raise ConfigError(f"{var}={env[var]!r} is not a hang action", hint=hint)
    return raw or contract.HANG_ACTIONS[0]


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0,2,5-7``."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][-1] + 1:
            spans[-1][1:] = [rank]
        else:
            spans.append([rank])
    text = ",".join("-".join(map(str, span)) for span in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def short_path(path: str) -> str:
    """The last two parts of a path, as the report writes call sites."""
    parts = path.replace("\\", "/").rsplit("/", 2)
    return "/".join(parts[-2:]) if len(parts) > 2 else path


def _call_text(call: Mapping[str, Any] | None) -> str:
    if not call:
        return "none"
    number = f" #{call['seq']}" if call.get("seq") is not None else ""
    sizes = f" {call['sizes']}" if call.get("sizes") else ""
    site = f" at {call['site']}" if call.get("site") else ""
    return f"{call['op']}{number}{sizes} on {call['group']}{site}"


def _who(rank: int, piece: Mapping[str, Any]) -> str:
    return f"rank {rank} (host {piece.get('host')}, pid {piece.get('pid')})"


def _doing(piece: Mapping[str, Any], others: str = "") -> str:
    """What the rank is doing; ``others``: the ranks waiting elsewhere, when this rank is the
    odd one out (then its rank-0-only ``if`` is named)."""
    call, under = piece.get("running"), piece.get("under")
    if call:
        doing = f"is in {_call_text(call)} (for {float(call['age_s']):.1f} s)"
        if under and others:
            doing += (
                f", called under `if {under['test']}:` ({short_path(str(under['file']))}:"
                f"{under['if_line']}), rank-0-only code that {others}"
            )
        return doing
    frame = piece.get("at")
    where = f"{frame[0]}:{frame[1]}" + (f" `{frame[3]}`" if frame[3] else "") if frame else ""
    last = piece.get("last")
    after = f"; its last collective: {_call_text(last)}" if last else "; no collective yet"
    loader = piece.get("loader")
    waiting = f", waiting for its data loader worker(s) (pids {loader})" if loader else ""
    return f"is in {where or 'an unknown place'}, not in a collective{waiting}{after}"


def diagnose(pieces: Pieces, world_size: int) -> tuple[list[int], list[int], list[int]]:
    """(the odd ranks out, the ranks waiting on them, the ranks that sent no piece). The waiters
    are the largest group in one collective; on a tie, ranks in rank-0-only code are odd, then
    the group holding the lowest rank waits."""
    silent = [rank for rank in range(world_size) if rank not in pieces]
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank in sorted(pieces):
        call = pieces[rank].get("running")
        if call:
            key = (str(call["op"]), str(call.get("seq")), str(call["group"]))
            groups.setdefault(key, []).append(rank)
    if not groups:
        return [], [], silent

    def likely_waiters(ranks: list[int]) -> tuple[int, bool, int]:
        return len(ranks), not any(pieces[rank].get("under") for rank in ranks), -min(ranks)

    waiters = max(groups.values(), key=likely_waiters)
    return [rank for rank in sorted(pieces) if rank not in waiters], waiters, silent


def headline(pieces: Pieces, world_size: int, waited_s: float, bound: str) -> str:
    """The one line that names the stuck rank(s) and where the others wait."""
    odd, waiters, silent = diagnose(pieces, world_size)
    others = f"{ranks_text(waiters)} skip{'s' if len(waiters) == 1 else ''}" if waiters else ""
    parts = [f"{_who(rank, pieces[rank])} {_doing(pieces[rank], others)}" for rank in odd]
    if silent:
        parts.append(
            f"{ranks_text(silent)} did not answer within the gathering time (frozen, or its "
            "threads cannot run: a long call holding the GIL?)"
        )
    if waiters:
        verb = "waits" if len(waiters) == 1 else "wait"
        parts.append(f"{ranks_text(waiters)} {verb} in {_call_text(pieces[waiters[0]]['running'])}")
    if not odd and not silent:
        parts.append("no rank stands out (all in the same place: a deadlock inside the backend?)")
    return f"ddpkit: hang: {'; '.join(parts)} (for {waited_s:.1f} s; bound: {bound})"


def report(
    pieces: Pieces,
    world_size: int,
    waited_s: float,
    bound: str,
    reporter: int,
    *,
    silent: Mapping[int, str] | None = None,
) -> str:
    """The headline, each rank's state, then the ranks grouped by identical stacks (the
    largest group last). ``silent``: what was done to get a silent rank's stacks."""
    lines = [headline(pieces, world_size, waited_s, bound)]
    lines.append(f"ddpkit: hang report (gathered by rank {reporter}), each rank:")
    stacks: dict[tuple[str, ...], list[int]] = {}
    for rank in range(world_size):
        piece = pieces.get(rank)
        if piece is None:
            lines.append(f"  rank {rank}: no answer{(silent or {}).get(rank, '')}")
            continue
        tail = ", ".join(_call_text(call) for call in piece.get("tail", [])[-3:])
        lines.append(f"  {_who(rank, piece)} {_doing(piece)}; before: {tail or 'none'}")
        stack = []
        for filename, line, function, code in (piece.get("stack") or [])[-_STACK_FRAMES:]:
            stack.append(f'  File "{filename}", line {line}, in {function}')
            stack += [f"    {code}"] if code else []
        stacks.setdefault(tuple(stack), []).append(rank)
    for frames, ranks in sorted(stacks.items(), key=lambda item: (len(item[1]), item[1][0])):
        lines.append(f"ddpkit: stack of {ranks_text(ranks)} (main thread, innermost last):")
        lines += frames or ["  (no stack)"]
    return "\n".join(lines)


@functools.cache
def _foreign_roots() -> tuple[str, ...]:
    import torch

    ddpkit = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    roots = {os.path.dirname(torch.__file__), ddpkit}
    roots |= {path for key in ("stdlib", "platstdlib") if (path := sysconfig.get_paths().get(key))}
    return tuple(os.path.join(root, "") for root in roots)


def is_program(filename: str) -> bool:
    """Whether ``filename`` is the program's (not torch's, ddpkit's, the stdlib's, generated)."""
    foreign = os.path.abspath(filename).startswith(_foreign_roots())
    return not filename.startswith("<") and not foreign


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):  # get_rank(), not get_rank(subgroup): a subgroup's rank 0
        return "" if node.args or node.keywords else _name(node.func)  # may call with peers
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def is_rank_zero_test(test: ast.expr) -> bool:
    """Whether an ``if`` test holds on rank 0 only (``a and <rank-zero test>`` too)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(is_rank_zero_test(value) for value in test.values)
    if isinstance(test, ast.Attribute | ast.Name | ast.Call):
        return _name(test) in _RANK_ZERO_FLAGS
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        sides = (test.left, test.comparators[0])
        zero = [
            isinstance(s, ast.Constant) and s.value == 0 and s.value is not False for s in sides
        ]
        return any(zero[i] and _name(sides[1 - i]) in _RANK_NAMES for i in (0, 1))
    return False


@functools.lru_cache(maxsize=64)
def _rank_zero_blocks(filename: str) -> tuple[tuple[int, int, int, str], ...]:
    """(body's first line, last line, the ``if``'s line, its test) of each rank-0-only ``if``
    without ``else`` in ``filename``."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return ()
    return tuple(
        (node.body[0].lineno, node.end_lineno or node.lineno, node.lineno, ast.unparse(node.test))
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and not node.orelse and is_rank_zero_test(node.test)
    )


def rank_zero_if(stack: Sequence[Sequence[Any]]) -> dict[str, Any] | None:
    """The rank-0-only ``if`` the innermost program frames of ``stack`` ([file, line, function,
    code] rows, outermost first) run under, as ``{"file", "line", "code", "if_line", "test"}``."""
    program = [row for row in reversed(stack) if is_program(str(row[0]))][:_MAX_FRAMES]
    for filename, line, _, code in program:
        blocks = [b for b in _rank_zero_blocks(str(filename)) if b[0] <= int(line) <= b[1]]
        if blocks:
            _, _, if_line, test = max(blocks)  # the innermost: it starts last
            return {
                "file": str(filename),
                "line": int(line),
                "code": str(code or ""),
                "if_line": if_line,
                "test": test,
            }
    return None
