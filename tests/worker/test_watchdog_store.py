"""The watchdog's store link against a real TCPStore: what rank 0 does to make every heartbeat
key exist, what that costs as the world grows, and that a rank which never beat at all is
still named."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from ddpkit.worker.rendezvous import batched
from ddpkit.worker.watchdog.policy import (
    SAY_TIMEOUT_S,
    beat_interval_for,
    beat_phase,
    interval_for,
    judging_parts,
    stale_gap_s,
)
from ddpkit.worker.watchdog.store import DEFAULT_OP_TIMEOUT_S, StoreLink
from tests.support.distutil import CountingStore


@pytest.fixture
def host() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _link(
    store: Any, rank: int, world: int, bound_s: float = 600.0, beat_interval_s: float | None = None
) -> StoreLink:
    return StoreLink(
        store,
        rank=rank,
        world_size=world,
        interval_s=min(1.0, bound_s / 4),
        bound_s=bound_s,
        host_rank=0,
        address="127.0.0.1:0",
        clock=time.monotonic,
        beat_interval_s=beat_interval_s,
    )


def _wait(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.05)


@pytest.mark.parametrize("world", [2, 64, 1024, 2500])
def test_rank_zero_creates_every_beat_key_in_one_call_a_slice_of_keys(
    host: TCPStore, world: int
) -> None:
    counted = CountingStore(PrefixStore("w", host))
    link = _link(counted, 0, world)
    link.start()
    try:
        # the keys are written a slice at a time: the last slice's last key ends it (waiting
        # for w/beat/0 alone read the keys between two slices once, in CI, at 2,500 ranks)
        _wait(lambda: host.check([f"w/beat/{world - 1}"]), 10)
        # then every key exists, readable without blocking, at 0 for the silent ranks
        keys = [f"w/beat/{rank}" for rank in range(world)]
        assert host.check(keys)
        assert [int(v) for v in host.multi_get(keys[1:])] == [0] * (world - 1)
        assert counted.calls.get("multi_set") == math.ceil(world / batched.KEYS_PER_CALL)
        # the start-up's store calls do not grow with the world (was one add per rank)
        assert counted.calls.get("add", 0) < 10
        # each judging round reads the counters with a multi_get a slice, never a check of N
        _wait(lambda: counted.calls.get("multi_get", 0) >= 2 * counted.calls["multi_set"], 10)
        assert counted.calls.get("check", 0) == 0
    finally:
        link.stop()


def test_a_beat_sent_before_rank_zero_arrived_keeps_counting(host: TCPStore) -> None:
    early = _link(PrefixStore("w", host), 1, 2)
    early.start()
    try:
        _wait(lambda: host.check(["w/beat/1"]), 10)
        zero = _link(PrefixStore("w", host), 0, 2)
        zero.start()
        try:
            _wait(lambda: host.check(["w/beat/0"]), 10)
            before = int(host.get("w/beat/1"))
            _wait(lambda: int(host.get("w/beat/1")) > before, 10)
        finally:
            zero.stop()
    finally:
        early.stop()


def test_ranks_that_never_sent_a_beat_are_named_after_the_bound(host: TCPStore) -> None:
    zero = _link(PrefixStore("w", host), 0, 3, bound_s=1.2)
    zero.start()
    try:
        _wait(lambda: _names(host) == {1, 2}, 15)
        assert {d.rank for d in zero.departures()} == {1, 2}
        for rank in (1, 2):
            marker = host.get(f"w/exit/{rank}").decode()
            assert "stopped sending heartbeats" in marker
    finally:
        zero.stop()


def test_rank_zero_judges_every_interval_while_the_others_beat_less_often(
    host: TCPStore,
) -> None:
    # a large world: the others beat once a beat interval (30 s here, what policy gives a
    # huge world at a long bound), rank 0 keeps its short interval, so a rank that stops
    # beating is still named within the bound + 2 intervals, long before one beat interval
    zero = _link(PrefixStore("w", host), 0, 3, bound_s=1.2, beat_interval_s=30.0)
    one = _link(PrefixStore("w", host), 1, 3, bound_s=1.2, beat_interval_s=30.0)
    zero.start()
    # rank 0 creates every beat key at 0: a beat of rank 1 sent before that is reset (harmless
    # in a job, where the next beat comes; here the next is 30 s away), so rank 1 starts after
    _wait(lambda: host.check(["w/beat/2"]), 10)
    one.start()
    try:
        _wait(lambda: host.check(["w/who/1"]), 10)  # rank 1 introduced itself
        _wait(lambda: int(host.get("w/beat/0")) >= 4, 10)  # rank 0: every 0.3 s
        # rank 1 not once: its first beat comes at its phase of the 30 s (11.5 s after start)
        assert int(host.get("w/beat/1")) == 0
        _wait(lambda: host.check(["w/exit/2"]), 10)  # rank 2 never beat: named after 1.2 s
        assert "stopped sending heartbeats" in host.get("w/exit/2").decode()
    finally:
        one.stop()
        zero.stop()


def test_the_watchdog_beats_at_its_worlds_interval(host: TCPStore) -> None:
    from ddpkit.worker.watchdog import hooks

    client = TCPStore("127.0.0.1", host.port, is_master=False)
    dog = hooks.start(rank=1, world_size=4096, bound_s=60.0, store=client)
    try:
        assert dog.interval_s == 1.0  # its judge samples as before
        assert dog._link.beat_interval_s == 8.0  # 4,096 ranks: 512 beats a second in all
    finally:
        hooks.stop()


class BeatTimes:
    """A real store that notes when each beat of its rank reached it."""

    def __init__(self, inner: Any, rank: int) -> None:
        self._inner, self._key, self.times = inner, f"beat/{rank}", list[float]()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def add(self, key: str, value: int) -> int:
        done = self._inner.add(key, value)
        if key == self._key and value:
            self.times.append(time.monotonic())
        return done


def test_ranks_let_go_together_beat_at_their_own_moments_of_the_interval(
    host: TCPStore,
) -> None:
    # before: every rank beat at once, then one whole interval after its last beat, so ranks
    # let go by one barrier beat (and polled) together for the whole run; now each beats first
    # at its own phase (policy.beat_phase), then once an interval, never less often
    from ddpkit.worker.watchdog.policy import beat_phase

    stores = {rank: BeatTimes(PrefixStore("w", host), rank) for rank in range(1, 8)}
    links = [_link(store, rank, 8, beat_interval_s=1.0) for rank, store in stores.items()]
    started = time.monotonic()
    for link in links:
        link.start()
    try:
        _wait(lambda: all(len(store.times) >= 2 for store in stores.values()), 20)
    finally:
        for link in links:
            link.stop()
    firsts = {rank: store.times[0] - started for rank, store in stores.items()}
    for rank, first in firsts.items():
        assert first >= beat_phase(rank) - 0.02, (rank, first)  # not before its moment
        assert first <= 1.0 + 2.0, (rank, first)  # within an interval (2 s for a slow start)
        # then on its grid, once an interval (policy.on_grid): the second beat not before its
        # phase + an interval. (Not "a whole interval after the first": a first beat that came
        # late, on a loaded machine, is followed by one less than an interval later, by design.)
        second = stores[rank].times[1] - started
        assert second >= beat_phase(rank) + 1.0 - 0.02, (rank, first, second)
    # phases 0.15 .. 0.91 of the interval: the first beats do not come together
    assert max(firsts.values()) - min(firsts.values()) >= 0.3, firsts


class DictStore:
    """The watchdog's store operations on a dict: rank 0's judging rounds, called directly."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.sets: list[str] = []
        self.most_keys = 0  # the most keys one check or multi_get named

    def set(self, key: str, value: str) -> None:
        self.sets.append(key)
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, value: int) -> int:
        now = int(self.data.get(key, b"0")) + value
        self.data[key] = str(now).encode()
        return now

    def check(self, keys: list[str]) -> bool:
        self.most_keys = max(self.most_keys, len(keys))
        return all(key in self.data for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.most_keys = max(self.most_keys, len(keys))
        return [self.data[key] for key in keys]

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.data[key] = value.encode()

    def append(self, key: str, value: str) -> None:
        self.data[key] = self.data.get(key, b"") + value.encode()


def test_rank_zero_names_each_silent_rank_of_a_huge_world_once_after_the_bound() -> None:
    world, bound_s = 100_000, 10.0
    store = DictStore()
    link = StoreLink(
        store, rank=0, world_size=world, interval_s=1.0, bound_s=bound_s, host_rank=0,
        address="x", clock=time.monotonic,
    )  # fmt: skip
    store.multi_set([f"beat/{rank}" for rank in range(world)], ["0"] * world)
    link._check_beats(0.0)  # the first round: every counter counts from now
    assert store.data["stale"] == b""  # and rank 0 publishes its (empty) list of stale ranks
    link._departed.add(9)  # rank 9 left with a marker of its own
    for now in (4.0, 8.0, 12.0):  # every rank beats, but 7 and 9 (and rank 0 itself)
        others = [f"beat/{rank}" for rank in range(10, world)]
        store.multi_set(others, [str(int(now))] * len(others))
        for rank in (1, 2, 3, 4, 5, 6, 8):
            store.add(f"beat/{rank}", 1)
        link._check_beats(now)
        named = [key for key in store.sets if key.startswith("exit/")]
        assert named == ([] if now < bound_s else ["exit/7"]), (now, named)
        # a failed collective's survivors read the ranks still for 2.2 beat intervals: 7 (9
        # has its marker), until it is judged gone and so marked
        assert store.data["stale"] == (b"7" if now < bound_s else b""), now
    # judged gone: a counter that moves again does not bring it back, nor name it twice
    store.multi_set([f"beat/{rank}" for rank in range(1, world)], ["13"] * (world - 1))
    link._check_beats(13.0)
    assert [key for key in store.sets if key.startswith("exit/")] == ["exit/7"]
    assert "stopped sending heartbeats 12 s ago" in store.get("exit/7").decode()
    assert link._presumed_dead == {7}
    # torch's store serves a call of N keys in more than linear time: read a slice at a time
    assert store.most_keys == batched.KEYS_PER_CALL


class RankZero:
    """Rank 0's round counter, bumped every 0.1 s under ``prefix`` until stopped."""

    def __init__(self, host: TCPStore, prefix: str) -> None:
        self._host, self._key, self._stop = host, f"{prefix}/beat/0", threading.Event()
        host.set(self._key, "0")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self._host.add(self._key, 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_a_survivors_hurry_reads_rank_zeros_list_two_keys_at_a_time(host: TCPStore) -> None:
    # each survivor of a failed collective compared two reads of every counter: N x N keys at
    # the store while the job fails (at 1,024 simulated ranks 7 survivors of 1,023 named the
    # silent rank within the 5 s). Now it reads rank 0's round counter and its list of stale
    # ranks: two keys a read, whatever the world
    world = 5000
    counted = CountingStore(PrefixStore("w", host))
    link = _link(counted, 1, world, beat_interval_s=0.25)  # a gap of 0.55 s fits in the hurry
    rank0 = RankZero(host, "w")
    link.start()
    try:
        _wait(lambda: host.check(["w/beat/1"]), 10)
        link.hurry(5.0)
        time.sleep(0.5)  # rank 0 has published nothing yet: nothing read, nobody silent
        assert link.silent() is None and counted.calls.get("multi_get", 0) == 0
        host.set("w/who/3", json.dumps({"host": "node3", "pid": 33, "node": "n3"}))
        host.set("w/stale", "3")
        _wait(lambda: link.silent() is not None, 5)
        (found,) = link.silent() or []
        assert (found.rank, found.node) == (3, "n3") and "node3" in found.who, found
        assert "33" in found.who and "stopped sending heartbeats" in found.how
        assert counted.most_keys <= 2, counted.most_keys
    finally:
        rank0.stop()
        link.stop()


def test_a_hurry_names_rank_zero_when_its_round_counter_stands_still(host: TCPStore) -> None:
    # under torchrun's agent store the store outlives rank 0: its judging stops with it, and
    # its own counter standing still for the gap names it (as two reads of it did before)
    link = _link(PrefixStore("w", host), 1, 4, beat_interval_s=0.25)
    host.set("w/beat/0", "7")
    host.set("w/stale", "")
    link.start()
    try:
        link.hurry(5.0)
        started = time.monotonic()
        _wait(lambda: link.silent() is not None, 5)
        assert [d.rank for d in link.silent() or []] == [0]
        assert time.monotonic() - started >= 2.2 * 0.25  # not before the gap
    finally:
        link.stop()


def test_past_the_gap_a_hurry_finds_nobody_at_once_unless_rank_zero_lists_a_rank(
    host: TCPStore,
) -> None:
    # at 4,096 ranks (8 s beats) a rank that stopped now is listed only after 17.6 s, past the
    # hurry: nobody is found at once (the excepthook does not wait for nothing), but a rank
    # rank 0 lists meanwhile (one silent for long) is still named
    link = _link(PrefixStore("w", host), 1, 4096, beat_interval_s=8.0)
    rank0 = RankZero(host, "w")
    host.set("w/stale", "")
    link.start()
    try:
        _wait(lambda: host.check(["w/beat/1"]), 10)
        link.hurry(5.0)
        assert link.silent() == []
        host.set("w/stale", "2")
        _wait(lambda: bool(link.silent()), 5)
        assert [d.rank for d in link.silent() or []] == [2]
    finally:
        rank0.stop()
        link.stop()


def test_the_hang_gatherer_reads_every_piece_a_slice_at_a_time(host: TCPStore) -> None:
    # a check and a get a rank took longer than the gathering's 5 s at ~25,000 ranks, and the
    # report came out without pieces: now two calls a slice of ranks that all answered
    world = 3000
    counted = CountingStore(PrefixStore("w", host))
    link = _link(counted, 0, world)
    keys = [f"w/hang/piece/{rank}" for rank in range(world) if rank != 7]  # rank 7 never answered
    batched.multi_set(host, keys, [json.dumps({"rank": int(k.rsplit("/", 1)[1])}) for k in keys])
    host.set("w/hang/piece/9", "not json")
    pieces = link.pieces()
    assert sorted(pieces) == [rank for rank in range(world) if rank not in (7, 9)]
    assert all(piece == {"rank": rank} for rank, piece in pieces.items())
    # slice 0 lacks rank 7: a check a rank there; slices 1 and 2 one check each; 3 multi_gets
    assert counted.calls == {"check": 1 + 1024 + 2, "multi_get": 3}


def _names(host: TCPStore) -> set[int]:
    return {rank for rank in (1, 2) if host.check([f"w/exit/{rank}"])}


class SlowDone:
    """A real store whose last operation (the ``done`` mark) takes ``delay_s``: a store host
    slow to answer while 16 ranks leave at once on 2 cores."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner, self._delay_s = inner, delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def add(self, key: str, value: int) -> int:
        if key == "done":
            time.sleep(self._delay_s)
        return self._inner.add(key, value)


@pytest.mark.parametrize("delay_s", [0.0, 1.5, 3.0])
def test_stop_outlasts_the_store_operation_in_flight(host: TCPStore, delay_s: float) -> None:
    """A store thread still inside a store call when the interpreter finalizes aborts the
    process (SIGABRT, 'terminate called without an active exception'): stop() at exit must
    return only once the thread is out of the store, within the operations' bound."""
    link = StoreLink(
        SlowDone(PrefixStore("t", host), delay_s), rank=0, world_size=1, interval_s=0.2,
        bound_s=600.0, host_rank=0, address="127.0.0.1:0", clock=time.monotonic,
        op_timeout_s=2.0,
    )  # fmt: skip
    link.start()
    _wait(lambda: host.check(["t/beat/0"]), 10.0)
    link.stop()
    assert not link._thread.is_alive()
    assert host.add("t/done", 0) == 1  # its last operation happened, before stop() returned


# --- the watchdog's own connection --------------------------------------------------------------


class SlowClone(dist.Store):
    """A real store (torch's own Python store type, so ``PrefixStore`` takes it) whose
    ``clone()`` waits for ``release``: a store host slow to accept a thousand connections."""

    def __init__(self, inner: TCPStore, release: threading.Event) -> None:
        super().__init__()
        self.inner, self.release, self.cloned = inner, release, threading.Event()

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self.inner.get(key))

    def add(self, key: str, value: int) -> int:
        return int(self.inner.add(key, value))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return list(self.inner.multi_get(keys))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.inner.multi_set(keys, values)

    def append(self, key: str, value: Any) -> None:
        self.inner.append(key, value)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def clone(self) -> TCPStore:
        assert self.release.wait(60), "the test never released the clone"
        self.cloned.set()
        return self.inner.clone()


def _prefix() -> str:
    from ddpkit.worker.watchdog import hooks
    from ddpkit.worker.watchdog.policy import KEY_PREFIX

    return f"{KEY_PREFIX}0/{hooks._PROCESS.generation}//"  # PrefixStore joins with a "/"


def test_start_returns_before_the_watchdog_has_its_own_connection(host: TCPStore) -> None:
    # init() waited for the clone: at thousands of ranks let go by one barrier, every rank's
    # init() queued behind a thousand connects to rank 0's store. The rank has introduced
    # itself when start() returns (over the group's connection), its own connection to come
    from ddpkit.worker.watchdog import hooks

    release = threading.Event()
    slow = SlowClone(TCPStore("127.0.0.1", host.port, is_master=False), release)
    started = threading.Thread(target=hooks.start, kwargs={
        "rank": 1, "world_size": 2, "bound_s": 60.0, "store": slow})  # fmt: skip
    started.start()
    try:
        started.join(30)
        assert not started.is_alive(), "start() waited for the watchdog's connection"
        assert host.check([f"{_prefix()}who/1"])  # who it is: known from init() on
        assert json.loads(host.get(f"{_prefix()}who/1"))["pid"] > 0
        time.sleep(0.6)  # past its phase (0.38 s of 1 s): it connects now, and waits for it
        assert not slow.cloned.is_set()
        assert not host.check([f"{_prefix()}beat/1"])
        release.set()
        _wait(lambda: host.check([f"{_prefix()}beat/1"]), 10)  # then it beats at once
        assert slow.cloned.is_set()
    finally:
        release.set()
        hooks.stop()


class _Timed:
    """A link's ``connect``: when it was called (monotonic), the store it hands back."""

    def __init__(self, store: Any) -> None:
        self.store, self.at = store, threading.Event()
        self.when: float | None = None

    def __call__(self) -> Any:
        self.when = time.monotonic()
        self.at.set()
        return self.store


def _deferred(host: TCPStore, rank: int, world: int, connect: Callable[[], Any]) -> StoreLink:
    """A link of ``rank`` with its own connection (``connect``) at the world's beat interval."""
    return StoreLink(
        CountingStore(PrefixStore("w", host)), rank=rank, world_size=world, interval_s=1.0,
        bound_s=600.0, host_rank=0, address="127.0.0.1:0", clock=time.monotonic,
        beat_interval_s=beat_interval_for(600.0, world), connect=connect,
    )  # fmt: skip


@pytest.mark.parametrize(("rank", "world"), [(0, 2), (1, 2), (2, 2048), (5, 2048), (1, 1024)])
def test_a_rank_connects_on_its_own_at_its_first_beats_phase(
    host: TCPStore, rank: int, world: int
) -> None:
    # thousands of ranks let go by one barrier connected at once, doubling the connects of
    # init()'s burst at rank 0's store: each now connects at its own phase of the interval,
    # then beats; before that it has made one store call (its introduction), none of its own
    # (rank 0: its first judging round, an interval in, then every beat key and a beat)
    phase_s = beat_interval_for(600.0, world) * beat_phase(rank)
    own = CountingStore(PrefixStore("w", host))
    connect = _Timed(own)
    link = _deferred(host, rank, world, connect)
    shared = link.kv
    started = time.monotonic()
    link.start()
    try:
        assert connect.at.wait(phase_s + 5), "no connection of its own"
        assert connect.when is not None and connect.when - started >= phase_s - 0.01
        # the beat, over its own: counted as the add begins (CountingStore counts, then calls),
        # so wait for the key too; rank 0's multi_set makes beat/0 exist just before its add
        _wait(lambda: own.calls.get("add", 0) >= 1 and host.check([f"w/beat/{rank}"]), 5)
        assert dict(shared.calls) == {"set": 1}  # who/<rank>, over the group's connection
        assert link.kv is own
    finally:
        link.stop()


def test_ranks_whose_connects_end_together_still_beat_at_their_own_phases(
    host: TCPStore,
) -> None:
    # the last connects of a start-up's ramp can end together (a busy store host, starved
    # threads): each rank's next beat came an interval after its late one, so those ranks beat
    # together in every interval of the run (a clump of ~170 ranks at 4,096, the store's busiest
    # 0.1 s at 3.2-4.4x its mean). Now the first late beat comes at once, the next ones at the
    # rank's own phase of each interval, as if none had been late.
    release = threading.Event()
    stores = {rank: BeatTimes(PrefixStore("w", host), rank) for rank in range(1, 8)}

    def connect(store: BeatTimes) -> Callable[[], Any]:
        def held() -> Any:
            assert release.wait(30), "the test never released the connects"
            return store

        return held

    links = [_deferred(host, rank, 8, connect(store)) for rank, store in stores.items()]  # 1 s
    started = time.monotonic()
    for link in links:
        link.start()
    try:
        time.sleep(1.2)  # past every rank's phase (0.15 .. 0.91 s): all wait on their connect
        release.set()
        _wait(lambda: all(len(store.times) >= 3 for store in stores.values()), 20)
    finally:
        release.set()
        for link in links:
            link.stop()
    firsts = [store.times[0] - started for store in stores.values()]
    assert max(firsts) - min(firsts) < 0.3, firsts  # the late beats: together, at the release
    for rank, store in stores.items():
        for at in store.times[1:3]:  # then back on the rank's grid: its phase + whole intervals
            off = (at - started - beat_phase(rank)) % 1.0
            assert off <= 0.25 or off >= 0.98, (rank, at - started, beat_phase(rank))
    seconds = [store.times[1] - started for store in stores.values()]
    assert max(seconds) - min(seconds) >= 0.5, seconds  # spread over the interval again


@pytest.mark.parametrize("cause", ["request", "hurry", "stop"])
def test_a_request_or_a_hurry_brings_the_connection_before_its_phase_the_exit_none(
    host: TCPStore, cause: str
) -> None:
    # rank 2 of 2,048 beats 3.06 s into its 4 s interval; what needs the store sooner gets it.
    # A rank that leaves first opens none (its last calls go over the shared connection): a
    # connect the exit would wait for, to a host that may be gone
    rank, world = 2, 2048
    assert beat_interval_for(600.0, world) * beat_phase(rank) > 3.0
    own = CountingStore(PrefixStore("w", host))
    connect = _Timed(own)
    link = _deferred(host, rank, world, connect)
    link.start()
    try:
        time.sleep(0.2)
        assert not connect.at.is_set()
        asked = time.monotonic()
        if cause == "request":
            assert link.call(lambda: link.kv.set("asked", "1"), 5.0)
            assert host.get("w/asked") == b"1" and own.calls.get("set") == 1
        elif cause == "hurry":
            link.hurry(1.0)
        else:
            link.stop()
            assert int(host.get("w/done")) == 1  # its last store call, over the shared one
            assert not connect.at.is_set() and not own.calls, own.calls
            return
        assert connect.at.wait(1.0), f"{cause}: no connection within 1 s"
        assert connect.when is not None and connect.when - asked < 1.0
    finally:
        link.stop()


def test_the_watchdogs_beats_are_not_queued_behind_the_programs_store_wait(
    host: TCPStore,
) -> None:
    # a TCPStore client runs one operation at a time: on the program's own connection, a
    # training script blocked in store.wait() would hold every heartbeat (and be named dead)
    from ddpkit.worker.watchdog import hooks

    client = TCPStore("127.0.0.1", host.port, is_master=False)
    hooks.start(rank=1, world_size=2, bound_s=2.0, store=client)  # beats every 0.5 s
    beat = f"{_prefix()}beat/1"
    try:
        _wait(lambda: host.check([beat]) and int(host.get(beat)) >= 1, 10)
        waited: list[BaseException] = []

        def program() -> None:
            try:
                client.wait(["never"], timedelta(seconds=4))
            except dist.DistStoreError as timed_out:
                waited.append(timed_out)

        blocked = threading.Thread(target=program)
        blocked.start()
        time.sleep(0.5)  # the program is inside its wait now
        before = int(host.get(beat))
        _wait(lambda: int(host.get(beat)) >= before + 3, 3.4)  # while it still waits
        assert blocked.is_alive()
        blocked.join(10)
        assert waited, "the program's wait did not time out as it should"
    finally:
        hooks.stop()


def test_a_slow_own_connection_is_not_taken_for_a_silent_store(host: TCPStore) -> None:
    # init() no longer waits for the watchdog's connection: a store slow to accept it (a
    # thousand ranks connecting at once) must not get the store's host named gone by the judge
    release = threading.Event()

    def connect() -> Any:
        assert release.wait(30)
        return PrefixStore("w", host)

    link = StoreLink(
        PrefixStore("w", host), rank=1, world_size=2, interval_s=0.1, bound_s=0.4,
        host_rank=0, address="127.0.0.1:0", clock=time.monotonic, connect=connect,
    )  # fmt: skip
    link.start()
    try:
        time.sleep(1.0)  # 2.5 bounds into the connect
        assert link.store_departure(time.monotonic()) is None
        release.set()
        _wait(lambda: host.check(["w/beat/1"]), 10)  # connected: it beats
        assert link.store_departure(time.monotonic()) is None  # it answers: not gone
        assert link.store_departure(time.monotonic() + 5.0) is not None  # silent 5 s: gone
    finally:
        release.set()
        link.stop()


EXIT_WHILE_CONNECTING = """
import os, signal, subprocess, sys, threading, time
from datetime import timedelta
from torch.distributed import TCPStore
from ddpkit.worker.watchdog import hooks
timeout_s, when = float(sys.argv[1]), sys.argv[2]
if when == "silent":  # a host that still accepts connections (the kernel's) and never answers
    host = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from torch.distributed import TCPStore; "
        "h = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
        "print(h.port, flush=True); time.sleep(300)")], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)  # nothing of the test's pipes held when frozen
    port = int(host.stdout.readline())
else:
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = host.port
client = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout_s))
if when == "silent":
    os.kill(host.pid, signal.SIGSTOP)  # a frozen rank 0
    print(host.pid, flush=True)
else:
    del host  # the store's host is gone: a connect retries until its timeout
own_connection, entered = hooks.own_connection, threading.Event()
def spied(*args, **kwargs):
    connect = own_connection(*args, **kwargs)
    def spy():
        entered.set()
        return connect()
    return spy
hooks.own_connection = spied
hooks.start(rank=1, world_size=2, bound_s=60.0, store=client)
if when != "at once":  # until its thread is inside torch's connect (its phase: < 15 s)
    assert entered.wait(30), "the watchdog never began to connect"
    time.sleep(0.2)
print("started", flush=True)
"""  # and the program ends, its watchdog's thread before or inside torch's connect


@pytest.mark.multiproc
@pytest.mark.sidecar  # up to ~25 s of waiting each
@pytest.mark.parametrize(
    ("timeout_s", "when"),
    [(30.0, "at once"), (0.5, "connecting"), (3.0, "connecting"), (11.5, "connecting"),
     (30.0, "connecting"), (3.0, "silent")],
)  # fmt: skip
def test_a_rank_that_ends_while_its_watchdog_connects_exits_with_its_own_code(
    tmp_path: Path, timeout_s: float, when: str
) -> None:
    # init() does not wait for the watchdog's own connection, so a program can end (or rank 0
    # vanish) before its thread connects (it then never does) or while it is inside torch's
    # connect: to a host that is gone, which torch retries until about twice its timeout (a
    # clone() with the group's 11.5 s came back past the exit's ~23 s wait in CI and aborted
    # the process: each try is now bounded by half an operation's timeout, 5 s), or to a frozen
    # one, which never answers (the process ends with the thread blocked, and it never comes
    # back). A thread that comes back from C++ into a finalizing interpreter aborts the process
    # (StoreLink.stop): the exit must be the program's own, 0, within the stop's bound.
    import os
    import signal

    from tests.support.spawned import child_env

    script = tmp_path / "exit_while_connecting.py"
    script.write_text(EXIT_WHILE_CONNECTING)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), str(timeout_s), when], env=child_env(),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    took = time.monotonic() - started
    for line in done.stdout.split() if when == "silent" else []:  # the frozen host: gone now
        if line.isdigit():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line), signal.SIGKILL)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    assert done.stdout.rstrip().endswith("started"), tail
    assert "terminate called" not in done.stderr, tail
    # the stop's bound (the say, then the link's two operation timeouts + 1 s, as hooks.start
    # sets them), + 15 s for the interpreter's start and exit, and up to 15 s to the phase
    op_timeout_s = max(DEFAULT_OP_TIMEOUT_S, 4 * interval_for(60.0))
    bound_s = SAY_TIMEOUT_S + 2 * op_timeout_s + 1 + 15 + 15
    assert took < bound_s, f"took {took:.1f} s: {tail}"
    if when == "at once":  # it never connects (torch would print each try's failure)
        assert "failed to connect" not in done.stderr, tail


def test_each_try_of_the_watchdogs_own_connect_ends_well_within_the_exits_wait() -> None:
    # bounded by half an operation's timeout (or the store's own, when shorter): torch tries
    # about twice, so a try at a host that is gone ends within ~one operation's timeout, well
    # inside the exit's two (StoreLink.stop), whatever the group's timeout
    from ddpkit.worker.watchdog.hooks import connect_timeout_s

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for group_s, expected_s in [(1800.0, 5.0), (11.5, 5.0), (3.0, 3.0), (0.5, 0.5)]:
        client = TCPStore("127.0.0.1", host.port, None, False, timedelta(seconds=group_s))
        assert connect_timeout_s(client, 10.0) == expected_s


def _store_host(port: int = 0) -> tuple[subprocess.Popen[str], int]:
    """A store's host in a process of its own (one this test can end), and its port."""
    host = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from torch.distributed import TCPStore; "
        f"h = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
        "print(h.port, flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert host.stdout is not None
    return host, int(host.stdout.readline())


@pytest.mark.parametrize("leaves", [False, True])
def test_the_own_connect_tries_again_until_the_stores_timeout_unless_the_rank_leaves(
    leaves: bool,
) -> None:
    # A try can fail on a live store (a name lookup the resolver drops takes 5 s, more than a
    # try's bound): the next one connects. Here the host is gone for ~2 s (tries of 0.5 s),
    # then back on its port: connected. A rank that leaves begins no try after the current one
    from ddpkit.worker.watchdog.hooks import own_connection

    first, port = _store_host()
    hosts = [first]
    try:
        client = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
        first.kill()  # gone: every try fails
        first.wait(10)
        left = threading.Event()
        connect = own_connection(
            PrefixStore("default_pg", client), "w", 1.0, leaving=left.is_set
        )  # fmt: skip
        found: list[Any] = []
        thread = threading.Thread(target=lambda: found.append(connect()), daemon=True)
        started = time.monotonic()
        thread.start()
        time.sleep(2.0)
        if leaves:  # the try in flight (<= ~2 x 0.5 s, and the 0.5 s pause), then none
            left.set()
            thread.join(10)
            took = time.monotonic() - started
            assert found == [None] and took < 2.0 + 2 * 0.5 + 0.5 + 1.5, took
            return
        hosts.append(_store_host(port)[0])
        thread.join(30)
        assert not thread.is_alive(), "the connect never ended"
        assert found[0] is not None, "no connection once the host was back"
        found[0].set("k", "v")  # the watchdog's prefix, on the store under default_pg
        fresh = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
        assert fresh.get("w/k") == b"v"
    finally:
        for host in hosts:
            host.kill()
            host.wait(10)


def test_rank_zero_reads_a_part_of_the_counters_a_round_and_still_names_a_silent_rank() -> None:
    # each counter moves once a beat interval (8 s at 4,096 ranks): rank 0 read every one each
    # second, 4,096 keys a second for ~512 moves. Now a quarter a round, each once in 4 s
    world, bound_s = 4096, 32.0
    beat_s = beat_interval_for(bound_s, world)
    assert (beat_s, judging_parts(world, 1.0, beat_s)) == (8.0, 4)

    class Reads(DictStore):
        def __init__(self) -> None:
            super().__init__()
            self.rounds: list[set[str]] = []

        def multi_get(self, keys: list[str]) -> list[bytes]:
            self.rounds[-1].update(keys)
            return super().multi_get(keys)

    store = Reads()
    link = StoreLink(
        store, rank=0, world_size=world, interval_s=1.0, bound_s=bound_s, host_rank=0,
        address="x", clock=time.monotonic, beat_interval_s=beat_s,
    )  # fmt: skip
    store.multi_set([f"beat/{rank}" for rank in range(world)], ["0"] * world)
    named_at, listed = None, {}
    for second in range(80):
        for rank in range(1, world):  # rank r beats when (t + r) % 8 == 0; 7 last at t = 17
            if (second + rank) % 8 == 0 and not (rank == 7 and second > 20):
                store.add(f"beat/{rank}", 1)
        store.rounds.append(set())
        link._check_beats(float(second))
        if named_at is None and "exit/7" in store.data:
            named_at = second
        listed[second] = store.data["stale"].decode()
    assert len(store.rounds[0]) == world  # the first round reads every counter
    for index in range(1, len(store.rounds) - 3):  # then each once in 4 rounds, 1,024 a round
        assert all(len(one) == 1024 for one in store.rounds[index : index + 4])
        assert set().union(*store.rounds[index : index + 4]) == {f"beat/{r}" for r in range(world)}
    assert [key for key in store.sets if key.startswith("exit/")] == ["exit/7"]
    assert named_at is not None and 17 + bound_s <= named_at <= 17 + bound_s + 4 + 2, named_at
    # listed for the survivors from 2.2 beat intervals + 3 rounds after its last beat (and
    # its last read of it) until named; nobody else ever
    gap_s = stale_gap_s(1.0, beat_s, 4)
    assert {value for value in listed.values()} == {"", "7"}
    first = min(second for second, value in listed.items() if value == "7")
    assert 17 + gap_s <= first <= 17 + gap_s + 4 + 1, first
    assert all(listed[second] == "" for second in range(named_at, 80))
