"""This rank's collectives, from torch's flight recorder (gloo's and NCCL's): read, never
rebuilt or patched; :func:`recording` enables it while ``init()`` makes its group. In a
collective: a group's last enqueued one is past its last completed one (the cheap status, each
interval); the entries (parsing them holds the GIL) are read once one has been open for a bound.
Past the first step: a collective made since the watchdog started completed twice alike.
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
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool"}  # fmt: skip
_PATIENT = [0]
_PATIENT_LOCK = threading.Lock()

Key = tuple[str, int]  # (group id, sequence number)


@contextlib.contextmanager
def recording(env: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """While a group is made: ``TORCH_FR_BUFFER_SIZE`` set when the user set no buffer size
    (torch reads it once), then removed again."""
    env = os.environ if env is None else env
    ours = not any(name in env for name in BUFFER_VARS)
    if ours:
        env[BUFFER_VARS[0]] = str(BUFFER_SIZE)
    try:
        yield
    finally:
        if ours:
            env.pop(BUFFER_VARS[0], None)


@contextlib.contextmanager
def patient() -> Iterator[None]:
    """Collectives inside wait for another rank's long solo work (a checkpoint's copy, write or
    read): the hang watchdog judges them by the first bound. Also a decorator."""
    with _PATIENT_LOCK:
        _PATIENT[0] += 1
    try:
        yield
    finally:
        with _PATIENT_LOCK:
            _PATIENT[0] -= 1


class Flight:
    """This rank's collectives as the recorder shows them (read on the watchdog's thread)."""

    def __init__(
        self,
        *,
        dump: Callable[[bool], Mapping[str, Any] | None] = compat.flight_recorder,
        wall_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._dump, self._wall_ns = dump, wall_ns
        self._since_ns = wall_ns()  # entries made before (init's own) are not this run's
        self._first_seen: dict[Key, float] = {}
        self._stale = self._opened()  # open before: a former group's, destroyed in flight
        self._retired: set[Key] = set()  # open by the status, retired by the entries
        self._patient: set[Key] = set()  # seen open inside patient(): it keeps the first bound
        self._looked: Key | None = None
        self.past_first_step = False

    def _opened(self) -> set[Key]:
        """Every number the status holds open (it lags: the first may be retired by its entry)."""
        dump = self._dump(False)
        status = _status(dump) if dump is not None else {}
        return {(g, seq) for g, (made, done) in status.items() for seq in range(done + 1, made + 1)}

    def in_collective(self) -> bool:
        """Whether a collective of this rank is in flight; True where there is no recorder."""
        if self._dump(False) is None:
            return True
        if not self._opened() - self._stale:
            return False
        entries, status = self._entries()
        return entries is None or any(_in_flight(entry, status) for entry in entries)

    def waiting(self, now: float) -> tuple[float, bool] | None:
        """(seconds, patient) of the collective open longest, or None when none is. Patient:
        inside :func:`patient` now, or that collective was seen open inside it (gloo records a
        completion after the call returned: a wait that just ended can still look open)."""
        opened = self._opened() - self._stale
        self._retired &= opened
        seen = self._first_seen
        self._first_seen = {key: seen.get(key, now) for key in opened - self._retired}
        if _PATIENT[0] > 0:
            self._patient |= self._first_seen.keys()
        self._patient &= self._first_seen.keys()
        if not self._first_seen:
            return None
        oldest = min(self._first_seen, key=self._first_seen.__getitem__)
        return now - self._first_seen[oldest], _PATIENT[0] > 0 or oldest in self._patient

    def look(self, now: float, *, again: bool = False) -> None:
        """Read the entries for the collective open longest: its age from its creation, whether
        it is retired after all, the phase; once a collective, unless ``again`` (retired since?)."""
        if not self._first_seen:
            return
        key = min(self._first_seen, key=self._first_seen.__getitem__)
        if key == self._looked and not again:
            return
        self._looked = key
        entries, status = self._entries()
        for entry in entries or []:
            if (_group(entry), _seq(entry)) != key or entry.get("is_p2p"):
                continue
            if entry.get("retired"):  # its completion not in the status yet: not open
                self._retired.add(key)
                del self._first_seen[key]
                self._looked = None
                break
            wall = self._wall_ns()
            made_s = max(0.0, (wall - int(entry.get("time_created_ns") or wall)) / 1e9)
            self._first_seen[key] = min(self._first_seen[key], now - made_s)
        self._phase(entries or [], status)

    def note_phase(self) -> bool:
        """Read the entries for the phase alone; whether the job is past its first step."""
        entries, status = self._entries()
        self._phase(entries or [], status)
        return self.past_first_step

    def _phase(self, entries: list[dict[str, Any]], status: dict[str, tuple[int, int]]) -> None:
        seen: set[tuple[str, ...]] = set()
        for entry in entries:
            if _in_flight(entry, status) or entry.get("is_p2p"):
                continue  # not completed (or point-to-point, numbered apart)
            alike = (
                _group(entry),
                str(entry.get("profiling_name")),
                repr(entry.get("input_sizes")),
                repr(entry.get("input_dtypes")),
            )
            if alike in seen:
                self.past_first_step = True
                return
            seen.add(alike)

    def _entries(self) -> tuple[list[dict[str, Any]] | None, dict[str, tuple[int, int]]]:
        """The collectives made since the watchdog started, oldest first, and the status."""
        dump = self._dump(True)
        if dump is None:
            return None, {}
        entries = [entry for entry in dump.get("entries") or [] if isinstance(entry, dict)]
        since = self._since_ns
        return [e for e in entries if int(e.get("time_created_ns") or 0) >= since], _status(dump)

    def calls(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """(the oldest collective in flight, the last completed ones), by :func:`describe`."""
        entries, status = self._entries()
        wall, running, done = self._wall_ns(), None, []
        for entry in entries or []:
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
    """Neither retired nor completed by the group's status."""
    if entry.get("retired") or entry.get("is_p2p"):
        return False
    return _seq(entry) > status.get(_group(entry), (0, -1))[1]


def _group(entry: Mapping[str, Any]) -> str:
    """The group's id, as the status names it (its name can be reused by a later group)."""
    return str(entry.get("pg_id", "?"))


def _seq(entry: Mapping[str, Any]) -> int:
    with contextlib.suppress(TypeError, ValueError):
        return int(entry.get("collective_seq_id") or 0)
    return 0


def describe(entry: Mapping[str, Any], wall_ns: int, *, running: bool) -> dict[str, Any]:
    """A recorder entry as the report writes a call: ``all_reduce #12 [1024] float32 on
    default_pg``."""
    name, desc = ([*(entry.get("process_group") or []), "", ""])[:2]
    sizes, dtypes = entry.get("input_sizes") or [], entry.get("input_dtypes") or []
    dtype = _DTYPES.get(str(dtypes[0]), str(dtypes[0]).lower()) if dtypes else ""
    if len(sizes) > 1 and all(size == sizes[0] for size in sizes):
        shape = f"{len(sizes)} x {list(sizes[0])}"  # a list of tensors alike
    else:
        shape = ", ".join(str(list(size)) for size in sizes)
    label = desc if desc not in ("", "undefined") else name
    group = DEFAULT_GROUP if desc == DEFAULT_GROUP else f"group {label}"
    return {
        "op": str(entry.get("profiling_name") or "?").split(":", 1)[-1],  # gloo:all_reduce
        "seq": entry.get("collective_seq_id"),
        "group": group,
        "sizes": f"{shape} {dtype}".strip(),
        "age_s": round((wall_ns - int(entry.get("time_created_ns") or wall_ns)) / 1e9, 3),
        "running": running,
    }
