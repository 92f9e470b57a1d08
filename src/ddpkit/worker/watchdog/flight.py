"""The hang watchdog's view of this rank's collectives: torch's flight recorder, read, not rebuilt.

torch records the collectives each process group issues, gloo's and NCCL's alike (torch 2.13):
the op, the group's sequence number, the input sizes and dtypes, when it was made, and per
group the last collective enqueued and the last completed. ddpkit wraps none of torch's
functions; the watchdog thread reads the recorder's JSON dump
(:func:`ddpkit.compat.flight_recorder`).

* Recording. torch 2.13 keeps the last 2,000 collectives by default; older versions only when
  ``TORCH_FR_BUFFER_SIZE`` (or ``TORCH_NCCL_TRACE_BUFFER_SIZE``) is set. While ``init()`` makes
  its group with the hang watchdog on, it sets ``TORCH_FR_BUFFER_SIZE=2000`` (torch 2.13's own
  default) when neither is set (:func:`recording`), and puts the environment back after.
* In a collective. A group whose last enqueued collective is past its last completed one has a
  collective in flight (a sync call waiting, DDP's gradient all-reduce inside ``backward()``,
  an async one not yet done). Read from the recorder's status alone, which is cheap, every
  interval; the time in it is counted from when the watchdog first saw it open.
* A long wait. Once that collective has been open for the shorter bound, the entries are read
  once (parsing them all holds the GIL a while): its creation time, whether it is retired
  after all (gloo's status can lag behind a call that returned), and the phase.
* The phase. The job is past its first step once a collective made after ``init()`` has
  completed twice alike (same group, op, sizes, dtypes): the loop has turned. Until then the
  generous first bound applies (rank 0 preparing data while the others wait at a barrier).
  ``init()``'s own collectives do not count; two identical collectives before the loop (two
  broadcasts of same-shaped tensors) do, as a call site seen twice did before.
* Patience. While a thread of this rank is inside :func:`patient` (a checkpoint's write on
  rank 0, which the others wait for), an open collective is judged by the first bound.

What the recorder does not give (the test shows it): the caller's file and line (its JSON dump
has no stack). The report takes the program's frame from the main thread's stack instead.
Where torch keeps no recorder (older torch on gloo, or a buffer size of 0 set by the user), the
hang watchdog has nothing to read and reports nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

from ddpkit import compat

BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
BUFFER_SIZE = 2000  # torch 2.13's default: where torch records already, nothing changes
DEFAULT_GROUP = "default_pg"
_DTYPES = {
    "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool",
}  # fmt: skip

Dump = Callable[[bool], Mapping[str, Any] | None]


@contextlib.contextmanager
def recording(env: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """While a group is made: ``TORCH_FR_BUFFER_SIZE`` set when the user set no buffer size
    (torch reads it once, at the recorder's first use), then removed again."""
    env = os.environ if env is None else env
    if any(name in env for name in BUFFER_VARS):
        yield
        return
    env[BUFFER_VARS[0]] = str(BUFFER_SIZE)
    try:
        yield
    finally:
        env.pop(BUFFER_VARS[0], None)


_PATIENT = [0]
_PATIENT_LOCK = threading.Lock()


@contextlib.contextmanager
def patient() -> Iterator[None]:
    """The collectives entered inside wait for another rank's long solo work (rank 0 writing a
    checkpoint while the others wait for its word): while any thread of this rank is inside,
    the hang watchdog judges an open collective by the generous first bound."""
    with _PATIENT_LOCK:
        _PATIENT[0] += 1
    try:
        yield
    finally:
        with _PATIENT_LOCK:
            _PATIENT[0] -= 1


def is_patient() -> bool:
    return _PATIENT[0] > 0


class Flight:
    """This rank's collectives as the recorder shows them; used by the watchdog thread (and,
    for :meth:`calls`, the store thread answering a hang report)."""

    def __init__(
        self,
        *,
        dump: Dump = compat.flight_recorder,
        wall_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._dump, self._wall_ns = dump, wall_ns
        # entries made before (init's own, a former group's) are not this run's
        self._since_ns = wall_ns()
        self._open: dict[tuple[str, int], float] = {}  # (group, seq) -> first seen open
        self._stale = self._opened()  # open before: a former group's, destroyed in flight
        self._done: set[tuple[str, int]] = set()  # open by the status, retired by the entries
        self._confirmed: tuple[frozenset[tuple[str, int]], bool] = (frozenset(), False)
        self._looked: tuple[str, int] | None = None
        self.past_first_step = False

    def _status(self) -> dict[str, tuple[int, int]] | None:
        """Each group's (last enqueued, last completed) sequence number; None: no recorder."""
        dump = self._dump(False)
        return None if dump is None else _status(dump)

    def _opened(self) -> set[tuple[str, int]]:
        status = self._status() or {}
        return {(group, done + 1) for group, (made, done) in status.items() if done < made}

    def in_collective(self) -> bool:
        """Whether a collective of this rank is in flight; True where there is no recorder (a
        rank blocked is then taken as waiting, as with the hang watchdog off)."""
        if self._status() is None:
            return True
        opened = frozenset(self._opened() - self._stale)
        if not opened:
            return False
        if opened != self._confirmed[0]:  # the entries, once per set of open collectives
            entries, status = self._entries()
            found = entries is None or any(_in_flight(entry, status) for entry in entries)
            self._confirmed = (opened, found)
        return self._confirmed[1]

    def waiting(self, now: float) -> tuple[float, bool] | None:
        """(seconds, patient) of the collective open longest, or None when none is: from the
        recorder's status alone."""
        opened = self._opened() - self._stale
        self._done &= opened
        self._open = {key: self._open.get(key, now) for key in opened - self._done}
        if not self._open:
            return None
        key = min(self._open, key=self._open.__getitem__)
        return now - self._open[key], is_patient()

    def look(self, now: float) -> None:
        """Read the entries once for the collective open longest: its age from its creation
        time (when it was made before the watchdog first saw it open), and the phase."""
        if not self._open:
            return
        key = min(self._open, key=self._open.__getitem__)
        if key == self._looked:
            return
        self._looked = key
        entries, status = self._entries()
        if entries is None:
            return
        wall = self._wall_ns()
        for entry in entries:
            if (_group(entry), _seq(entry)) != key or entry.get("is_p2p"):
                continue
            if entry.get("retired"):  # its completion not in the status yet: not open
                self._done.add(key)
                del self._open[key]
                self._looked = None
                break
            made_s = (wall - int(entry.get("time_created_ns") or wall)) / 1e9
            self._open[key] = min(self._open[key], now - max(made_s, 0.0))
        self._phase(entries, status)

    def note_phase(self) -> bool:
        """Read the entries for the phase alone; whether the job is past its first step."""
        entries, status = self._entries()
        self._phase(entries or [], status)
        return self.past_first_step

    def _phase(self, entries: list[dict[str, Any]], status: dict[str, tuple[int, int]]) -> None:
        seen: set[tuple[Any, ...]] = set()
        for entry in entries:
            if _in_flight(entry, status) or entry.get("is_p2p"):
                continue  # not completed (or point-to-point, numbered apart)
            alike = (_group(entry), entry.get("profiling_name"), repr(entry.get("input_sizes")),
                     repr(entry.get("input_dtypes")))  # fmt: skip
            if alike in seen:
                self.past_first_step = True
                break
            seen.add(alike)

    def _entries(self) -> tuple[list[dict[str, Any]] | None, dict[str, tuple[int, int]]]:
        """The collectives made since the watchdog started, oldest first, and the status."""
        dump = self._dump(True)
        if dump is None:
            return None, {}
        entries = [
            entry
            for entry in dump.get("entries") or []
            if isinstance(entry, dict) and int(entry.get("time_created_ns") or 0) >= self._since_ns
        ]
        return entries, _status(dump)

    def calls(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """(the oldest collective in flight, the last completed ones, oldest first), each as
        :func:`describe` makes it; what a rank's piece of a hang report says."""
        entries, status = self._entries()
        if not entries:
            return None, []
        wall = self._wall_ns()
        running, done = None, []
        for entry in entries:
            if entry.get("is_p2p"):
                continue
            if _in_flight(entry, status):
                running = running or describe(entry, wall, running=True)
            else:
                done.append(describe(entry, wall, running=False))
        return running, done[-4:]


def _status(dump: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    status = {}
    for group, numbers in (dump.get("pg_status") or {}).items():
        with contextlib.suppress(TypeError, ValueError, KeyError, AttributeError):
            enqueued = int(numbers["last_enqueued_collective"])
            status[str(group)] = (enqueued, int(numbers["last_completed_collective"]))
    return status


def _in_flight(entry: Mapping[str, Any], status: Mapping[str, tuple[int, int]]) -> bool:
    """Neither retired (gloo marks DDP's all-reduce so late) nor completed by the group's status
    (which can lag behind a collective that returned)."""
    if entry.get("retired") or entry.get("is_p2p"):
        return False
    return _seq(entry) > status.get(_group(entry), (0, -1))[1]


def _group(entry: Mapping[str, Any]) -> str:
    """The group's id, as the status names it (its name can be reused by a later group)."""
    return str(entry.get("pg_id", "?"))


def _seq(entry: Mapping[str, Any]) -> int:
    try:
        return int(entry.get("collective_seq_id") or 0)
    except (TypeError, ValueError):
        return 0


def describe(entry: Mapping[str, Any], wall_ns: int, *, running: bool) -> dict[str, Any]:
    """A recorder entry as the report writes a call: ``all_reduce #12 [1024] float32 on
    default_pg`` (the caller's place is not in it: the piece adds the program's frame)."""
    name, desc = ([*(entry.get("process_group") or []), "", ""])[:2]
    group = f"group {desc if desc not in ('', 'undefined') else name}"
    op = str(entry.get("profiling_name") or "?")
    return {
        "op": op.split(":", 1)[-1],  # gloo:all_reduce, nccl:all_reduce
        "seq": entry.get("collective_seq_id"),
        "group": DEFAULT_GROUP if desc == DEFAULT_GROUP else group,
        "sizes": _sizes(entry.get("input_sizes") or [], entry.get("input_dtypes") or []),
        "age_s": round((wall_ns - int(entry.get("time_created_ns") or wall_ns)) / 1e9, 3),
        "running": running,
    }


def _sizes(sizes: list[Any], dtypes: list[Any]) -> str:
    """``[1024] float32``; ``3 x [8] float32`` for a list of tensors alike; '' for none."""
    if not sizes:
        return ""
    dtype = _DTYPES.get(str(dtypes[0]), str(dtypes[0]).lower()) if dtypes else ""
    if len(sizes) > 1 and all(size == sizes[0] for size in sizes):
        return f"{len(sizes)} x {list(sizes[0])} {dtype}".rstrip()
    return f"{', '.join(str(list(size)) for size in sizes)} {dtype}".rstrip()
