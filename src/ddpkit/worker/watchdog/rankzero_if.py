"""Rank-0-only code in a hang report: ``rank 0 waits in barrier() under `if is_main:` ...``.

``if ctx.is_main: save(...)`` where ``save`` calls ``dist.barrier()`` is the classic hang: rank 0
enters a collective the other ranks never call. Whether a given ``if`` is such a block is a
guess from source text: ``main_process_first`` (Accelerate, transformers) calls ``barrier()``
under ``if is_main:`` on rank 0 and in another place on the others, and is correct. So nothing
here runs before a collective, and nothing here raises: once the hang watchdog has seen a hang
(a rank in one collective past its bound), each rank's answer names the innermost ``if`` of the
program (not torch's, ddpkit's or the standard library's frames) whose test holds on rank 0 only
(``ctx.is_main``, ``rank == 0``, ``dist.get_rank() == 0``, ``is_global_zero``, ...), that has no
``else`` (where the others may make the matching call) and whose body holds the frame that
called the collective; the report then says that the rank waits there and that the other ranks
skip it. Collectives of a subgroup are not judged (its rank 0 may well call them with its peers).
The source of each file is read through :mod:`linecache` and parsed once, at report time only.
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

    roots = {
        os.path.dirname(torch.__file__),
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    }
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(path)
    return tuple(os.path.join(root, "") for root in roots)


def is_program(filename: str) -> bool:
    """Whether a frame of ``filename`` is the program's own (not torch's, ddpkit's, the
    standard library's, nor generated code's)."""
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(
        _foreign_roots()
    )


def is_rank_zero_test(test: ast.expr) -> bool:
    """Whether an ``if`` test holds on rank 0 only (``a and <rank-zero test>`` too)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(is_rank_zero_test(value) for value in test.values)
    if isinstance(test, ast.Attribute | ast.Name):
        return _name(test) in _RANK_ZERO_FLAGS
    if isinstance(test, ast.Call) and not test.args:
        return _name(test.func) in _RANK_ZERO_FLAGS
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        left, right = test.left, test.comparators[0]
        return (_is_zero(right) and _is_rank(left)) or (_is_zero(left) and _is_rank(right))
    return False


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _is_rank(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):  # get_rank(), not get_rank(subgroup): a subgroup's rank 0
        if node.args or node.keywords:  # may well call a collective with its peers
            return False
        node = node.func
    return _name(node) in _RANK_NAMES


@functools.lru_cache(maxsize=64)
def _rank_zero_blocks(filename: str) -> tuple[tuple[int, int, int, str], ...]:
    """(first line of the body, last line, line of the ``if``, its test) of each rank-0-only
    ``if`` without ``else`` in ``filename``."""
    source = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and not node.orelse and is_rank_zero_test(node.test):
            last = max(getattr(stmt, "end_lineno", None) or stmt.lineno for stmt in node.body)
            found.append((node.body[0].lineno, last, node.lineno, ast.unparse(node.test)))
    return tuple(found)


@functools.lru_cache(maxsize=4096)
def _enclosing(filename: str, line: int) -> tuple[int, str] | None:
    """The innermost rank-0-only ``if`` of ``filename`` whose body holds ``line``."""
    blocks = [b for b in _rank_zero_blocks(filename) if b[0] <= line <= b[1]]
    if not blocks:
        return None
    first = max(blocks, key=lambda block: block[0])
    return first[2], first[3]


def rank_zero_if(stack: Sequence[Sequence[Any]]) -> dict[str, Any] | None:
    """The rank-0-only ``if`` the innermost program frames of ``stack`` run under, if any.

    ``stack`` holds [file, line, function, code] rows, outermost first (as a hang report's
    piece carries them). The program's frames are read innermost first, at most
    :data:`_MAX_FRAMES` of them; the first one inside a rank-0-only block gives the answer:
    ``{"file", "line", "code", "if_line", "test"}`` (the frame's file and line, the ``if``'s
    line and its test as written), else None.
    """
    seen = 0
    for row in reversed(stack):
        filename, line, code = str(row[0]), int(row[1]), str(row[3] or "")
        if not is_program(filename):
            continue
        block = _enclosing(filename, line)
        if block is not None:
            return {
                "file": filename, "line": line, "code": code,
                "if_line": block[0], "test": block[1],
            }  # fmt: skip
        seen += 1
        if seen >= _MAX_FRAMES:
            break
    return None
