"""ddpkit's own record of the collectives this process calls: what a hang report quotes.

While a hang watchdog runs, the collectives of ``torch.distributed`` (``all_reduce``,
``barrier``, ``broadcast_object_list``, ...) are replaced, in ``torch.distributed`` and in
``torch.distributed.distributed_c10d``, by thin wrappers that note each call on entry and on
return: the op, the group's sequence number (torch's own counter, the number its flight
recorder shows; ddpkit's count where torch has none), the first tensor's shape and dtype, the
group, the caller's file and line, and the monotonic times. A call made from inside another
(``broadcast_object_list`` calling ``broadcast``) is the outer one's business and is not noted.
Only the last :data:`TAIL` calls are kept. ``uninstall`` puts torch's functions back. Under
``torch.compile`` a wrapper steps aside (dynamo traces torch's own function): collectives in a
compiled graph are not noted here, torch's flight recorder still sees them.

``torch.autograd.backward`` (``loss.backward()``) is noted as a collective too: DDP's gradient
all-reduces run inside it, from C++, and a rank whose peer is stuck waits there. Not seen:
other collectives torch issues from C++ and code that bound a function before the watchdog
started (``from torch.distributed import all_reduce`` at import): the report then rests on the
stacks (and torch's flight recorder) alone.

The phase: a job is past its first step once a call site comes round a second time (the loop
has turned); until then the generous first bound applies (see :mod:`.hang`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ddpkit.worker.watchdog.hang import short_path

TAIL = 16
# ``torch.autograd.backward`` (what ``loss.backward()`` calls) counts as a collective: DDP runs
# its gradient all-reduces from C++ inside it, where no Python wrapper sees them, and a rank
# waits there for the others; its number is the group's next collective.
BACKWARD = "backward"
_MAX_TORCH_FRAMES = 8


def _torch_dir() -> str:
    try:
        import torch

        return os.path.join(os.path.dirname(torch.__file__), "")
    except ImportError:
        return "\0"


# The collectives every rank of a group must call alike (point-to-point ops are not here).
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


@dataclass(slots=True, eq=False)
class Call:
    """One collective this process entered; ``left_at`` is None while it runs. Noted raw (the
    group object, the first argument's shape and dtype, the caller's file and line) and
    formatted only when a report asks: noting costs a few microseconds."""

    op: str
    seq: int | None  # the group's sequence number of this call (1 = its first)
    group: Any  # the ProcessGroup; None: the default group
    shape: Any  # the first argument's shape; (count, shape) for a list
    dtype: Any
    filename: str
    line: int
    thread: int
    entered_at: float
    left_at: float | None = None
    patient: bool = False  # it waits for a rank's long solo work: the generous bound applies

    @property
    def site(self) -> str:
        return f"{short_path(self.filename)}:{self.line}"

    @property
    def sizes(self) -> str:
        """``[1024] float32``, ``3 x [8] float32`` for a list of tensors, ``3 objects``."""
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype is not None else ""
        if isinstance(self.shape, tuple) and len(self.shape) == 2 and self.shape[0] == "list":
            return f"{self.shape[1]} objects"
        if isinstance(self.shape, tuple) and len(self.shape) == 3 and self.shape[0] == "list":
            return f"{self.shape[1]} x {list(self.shape[2])} {dtype}".rstrip()
        return "" if self.shape is None else f"{list(self.shape)} {dtype}".rstrip()

    def describe(self) -> str:
        """``all_reduce #12 [1024] float32 on default_pg at train.py:88``."""
        number = f" #{self.seq}" if self.seq is not None else ""
        sizes = f" {self.sizes}" if self.sizes else ""
        return f"{self.op}{number}{sizes} on {_group_of(self.group)[0]} at {self.site}"

    def as_dict(self, now: float) -> dict[str, Any]:
        name, size = _group_of(self.group)
        return {
            "op": self.op,
            "seq": self.seq,
            "group": name,
            "group_size": size,
            "sizes": self.sizes,
            "site": self.site,
            "age_s": round(now - self.entered_at, 3),
            "running": self.left_at is None,
        }


class Record:
    """The calls of this process; written by the calling threads, read by the watchdog (the
    GIL makes each deque append and dict update atomic: no lock on the calling path)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        sequence: Callable[[Any], int | None] | None = None,
    ) -> None:
        self._clock = clock
        self._torch_dir = _torch_dir()
        self._sequence = sequence  # the group's torch counter (before the call), if any
        self._tail: deque[Call] = deque(maxlen=TAIL)
        self._running: dict[int, Call] = {}
        self._counts: dict[int, int] = {}  # id(group) -> calls, where torch counts none
        self._sites: set[tuple[int, int]] = set()  # (id of the caller's code, line)
        self._local = threading.local()
        self.past_first_step = False

    def calls(self) -> list[Call]:
        return list(self._tail)

    def running(self) -> list[Call]:
        """The calls entered and not returned, oldest first."""
        return sorted(list(self._running.values()), key=lambda call: call.entered_at)

    def last(self) -> Call | None:
        tail = self.calls()
        return tail[-1] if tail else None

    def wrap(self, op: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` noting each outermost call in this record."""
        local = self._local
        group_type = _group_type()
        compiling = _is_compiling()

        @functools.wraps(function)
        def noted(*args: Any, **kwargs: Any) -> Any:
            # first: under torch.compile, dynamo takes this for True and traces torch's own
            # function, which it turns into a traceable collective (it knows torch's functions,
            # not this wrapper; the wrapper's frame look-ups would break the graph)
            if compiling():
                return function(*args, **kwargs)
            if getattr(local, "depth", 0):
                return function(*args, **kwargs)
            group = kwargs.get("group")
            if group is None and len(args) > 1:
                for arg in args:
                    if type(arg) is group_type:
                        group = arg
                        break
            first = args[0] if args and op != BACKWARD else None
            call = self._enter(op, group, first, sys._getframe(1))
            if getattr(local, "patient", False):
                call.patient = True
            local.depth = 1
            try:
                return function(*args, **kwargs)
            finally:
                local.depth = 0
                call.left_at = self._clock()
                if self._running.get(call.thread) is call:
                    del self._running[call.thread]

        noted.__ddpkit_noted__ = True  # type: ignore[attr-defined]
        return noted

    def _enter(self, op: str, group: Any, first: Any, caller: Any) -> Call:
        for _ in range(_MAX_TORCH_FRAMES):  # the program's call, not torch's own
            outer = caller.f_back
            if outer is None or not caller.f_code.co_filename.startswith(self._torch_dir):
                break
            caller = outer
        code, line = caller.f_code, caller.f_lineno
        del caller
        before = self._sequence(group) if self._sequence is not None else None
        if before is None:
            before = self._counts.get(id(group), 0)
            self._counts[id(group)] = before + 1
        shape, dtype = getattr(first, "shape", None), getattr(first, "dtype", None)
        if shape is None and type(first) is list:
            inner = getattr(first[0], "shape", None) if first else None
            dtype = getattr(first[0], "dtype", None) if first else None
            shape = ("list", len(first)) if inner is None else ("list", len(first), inner)
        thread = threading.get_ident()
        call = Call(
            op, before + 1, group, shape, dtype, code.co_filename, line, thread, self._clock()
        )
        site = (id(code), line)
        if site in self._sites:
            self.past_first_step = True
        else:
            self._sites.add(site)
        self._running[thread] = call
        self._tail.append(call)
        return call


def _is_compiling() -> Callable[[], bool]:
    """``torch.compiler.is_compiling`` (public since torch 2.3), else never."""
    try:
        import torch.compiler

        return torch.compiler.is_compiling
    except (ImportError, AttributeError):
        return lambda: False


def _group_type() -> type | None:
    try:
        import torch.distributed as dist

        return dist.ProcessGroup
    except (ImportError, AttributeError):
        return None


def _group_of(group: Any) -> tuple[str, int]:
    """The group's name and size; the default group when ``group`` is None."""
    try:
        import torch.distributed as dist

        pg = group if group is not None else dist.group.WORLD
        if pg is None:
            return "default_pg", 0
        name = "default_pg" if group is None else str(getattr(pg, "group_name", "") or "group")
        return name, int(pg.size())
    except Exception:
        return "group", 0


# --- installing it in torch.distributed ---------------------------------------------------------


@dataclass
class _Installed:
    record: Record
    originals: dict[tuple[str, str], Any]


_INSTALLED: list[_Installed] = []


def install(record: Record) -> None:
    """Replace torch's collectives by ``record``'s wrappers (replacing any earlier record)."""
    import torch.autograd
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    uninstall()
    originals: dict[tuple[str, str], Any] = {}
    backward = torch.autograd.backward
    if not getattr(backward, "__ddpkit_noted__", False):
        originals[(torch.autograd.__name__, "backward")] = backward
        torch.autograd.backward = record.wrap(BACKWARD, backward)
    for op in COLLECTIVES:
        function = getattr(distributed_c10d, op, None)
        if function is None or getattr(function, "__ddpkit_noted__", False):
            continue
        noted = record.wrap(op, function)
        for module in (dist, distributed_c10d):
            if getattr(module, op, None) is function:
                originals[(module.__name__, op)] = function
                setattr(module, op, noted)
    _INSTALLED.append(_Installed(record, originals))


def uninstall() -> None:
    """Put back torch's functions where ddpkit's wrappers still stand."""
    while _INSTALLED:
        installed = _INSTALLED.pop()
        for (module_name, op), function in installed.originals.items():
            module = sys.modules.get(module_name)
            if module is not None and getattr(getattr(module, op, None), "__ddpkit_noted__", False):
                setattr(module, op, function)


def installed() -> Record | None:
    return _INSTALLED[-1].record if _INSTALLED else None


@contextlib.contextmanager
def patient() -> Iterator[None]:
    """The collectives this thread enters inside wait for another rank's long solo work (rank
    0 writing a checkpoint while the others wait for its word): the hang watchdog judges them
    by the generous first bound, not the per-collective one."""
    record = installed()
    if record is None:
        yield
        return
    local = record._local
    before = getattr(local, "patient", False)
    local.patient = True
    try:
        yield
    finally:
        local.patient = before
