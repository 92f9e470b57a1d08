"""The guard against the classic hang: a collective inside rank-0-only code.

``if ctx.is_main: save(...)`` where ``save`` calls ``dist.barrier()``: rank 0 enters a
collective the other ranks never call, and every rank waits for the collective timeout. On
rank 0 only, before each collective, the guard looks at the calling frames of the program (not
torch's, not ddpkit's, not the standard library's) and raises :class:`~ddpkit.errors.UsageError`
at once when one of them is inside the body of an ``if`` whose test holds only on rank 0
(``ctx.is_main``, ``rank == 0``, ``dist.get_rank() == 0``, ``is_global_zero``, ...) and which has
no ``else`` (an ``else`` may hold the other ranks' matching call). Only collectives of the
default group are guarded (in a subgroup, ``if dist.get_rank(pp) == 0:`` may well hold on
every member), and point-to-point ops are not. The source of each file is parsed once; the
answer for each (file, line) is cached, so the check costs a few dictionary look-ups per call.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import sys
import sysconfig
from types import FrameType
from typing import Any

from ddpkit.errors import UsageError

_MAX_FRAMES = 8
_RANK_ZERO_FLAGS = ("is_main", "is_main_process", "is_global_zero", "is_rank_zero", "is_master")
_RANK_NAMES = ("rank", "global_rank", "get_rank", "get_global_rank", "process_index")


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


_CACHE_MAX = 65536


class RankZeroGuard:
    """Called before each collective; raises inside rank-0-only code. One dictionary look-up
    per calling frame (by code object and line), a parse the first time a file is seen."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._foreign = _foreign_roots()
        # (id of a code object, line) -> (the code object, the answer); the code object is
        # compared too, since an id may be reused once a code object is gone
        self._seen: dict[tuple[int, int], tuple[object, tuple[int, str] | None]] = {}

    def _is_program(self, filename: str) -> bool:
        return not filename.startswith("<") and not os.path.abspath(filename).startswith(
            self._foreign
        )

    def _lookup(self, filename: str, line: int) -> tuple[int, str] | None:
        return _enclosing(filename, line) if self._is_program(filename) else None

    def __call__(self, op: str, group: Any) -> None:
        if group is not None and group is not self._dist.group.WORLD:
            return  # a subgroup: its rank 0 may well call collectives with its peers
        seen = self._seen
        frame: FrameType | None = sys._getframe(2)
        try:
            for _ in range(_MAX_FRAMES):
                if frame is None:
                    return
                code, line = frame.f_code, frame.f_lineno
                entry = seen.get((id(code), line))
                if entry is None or entry[0] is not code:
                    if len(seen) >= _CACHE_MAX:
                        seen.clear()
                    entry = seen[(id(code), line)] = (code, self._lookup(code.co_filename, line))
                if entry[1] is not None:
                    raise _error(op, frame, entry[1])
                frame = frame.f_back
        finally:
            del frame


def _error(op: str, frame: FrameType, block: tuple[int, str]) -> UsageError:
    filename, line = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(filename, line).strip()
    if_line, test = block
    return UsageError(
        f"collective {op}() called inside rank-0-only code: {filename}:{line} `{code}` runs "
        f"under `if {test}:` (line {if_line}), which the other ranks skip: they would never "
        "join it, and every rank would wait for the collective timeout",
        hint=(
            "move the collective out of the `if` (every rank must call it), or give the `if` "
            "an `else:` in which the other ranks make the matching call"
        ),
    )
