"""Rank-0-only code in a hang report: ``rank 0 waits in barrier() under `if is_main:` ...``.

``if ctx.is_main: save(...)`` where ``save`` calls ``dist.barrier()`` is the classic hang. Whether
an ``if`` is such a block is a guess from source text (``main_process_first`` calls ``barrier()``
under ``if is_main:`` on rank 0 and elsewhere on the others, and is correct), so nothing here
runs before a collective or raises: once the hang watchdog has seen a hang, each rank's answer
names the innermost ``if`` of the program whose test holds on rank 0 only (``ctx.is_main``,
``rank == 0``, ``dist.get_rank() == 0``, ...), that has no ``else`` and whose body holds the
frame that called the collective. Sources are parsed at report time only.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import sysconfig
from collections.abc import Sequence
from typing import Any

_MAX_FRAMES = 8
_RANK_ZERO_FLAGS = ("is_main", "is_main_process", "is_global_zero", "is_rank_zero", "is_master")
_RANK_NAMES = ("rank", "global_rank", "get_rank", "get_global_rank", "process_index")


@functools.cache
def _foreign_roots() -> tuple[str, ...]:
    """Folders whose frames are not the program's: torch, ddpkit, the standard library."""
    import torch

    ddpkit = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    roots = {os.path.dirname(torch.__file__), ddpkit}
    roots |= {path for key in ("stdlib", "platstdlib") if (path := sysconfig.get_paths().get(key))}
    return tuple(os.path.join(root, "") for root in roots)


def is_program(filename: str) -> bool:
    """Whether a frame of ``filename`` is the program's own (not torch's, ddpkit's, the
    standard library's, nor generated code's)."""
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
    """(first line of the body, last line, line of the ``if``, its test) of each rank-0-only
    ``if`` without ``else`` in ``filename``."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return ()
    return tuple(
        (
            node.body[0].lineno,
            max(s.end_lineno or s.lineno for s in node.body),
            node.lineno,
            ast.unparse(node.test),
        )
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and not node.orelse and is_rank_zero_test(node.test)
    )


def rank_zero_if(stack: Sequence[Sequence[Any]]) -> dict[str, Any] | None:
    """The rank-0-only ``if`` the innermost program frames of ``stack`` ([file, line,
    function, code] rows, outermost first) run under: the first of at most
    :data:`_MAX_FRAMES` program frames inside one gives ``{"file", "line", "code", "if_line",
    "test"}``; else None."""
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
