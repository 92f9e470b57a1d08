"""The watchdog's store link against a real TCPStore: what rank 0 does to make every heartbeat
key exist, what that costs as the world grows, that a rank which never beat at all is still
named, and that every store operation (and so the exit) is bounded."""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from ddpkit.worker.rendezvous import batched
from ddpkit.worker.watchdog.store import StoreLink
from tests.support.distutil import FORKSERVER_PRELOAD, CountingStore


@pytest.fixture
def host() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


class Running:
    """A link driven as the watchdog's thread drives it (``step`` each time it is due), without
    the judging that could end the test's process."""

    def __init__(self, link: StoreLink) -> None:
        self.link, self._stop = link, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.link, name)

    def _run(self) -> None:
        while not self._stop.is_set():
            due = self.link.step(time.monotonic())
            self._stop.wait(max(0.0, min(due, time.monotonic() + 0.05) - time.monotonic()))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _link(
    store: Any, rank: int, world: int, bound_s: float = 600.0, beat_interval_s: float | None = None
) -> Running:
    return Running(
        StoreLink(
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
        assert int(host.get("w/beat/1")) <= 1  # rank 1: at start, then 30 s later
        _wait(lambda: host.check(["w/exit/2"]), 10)  # rank 2 never beat: named after 1.2 s
        assert "stopped sending heartbeats" in host.get("w/exit/2").decode()
    finally:
        one.stop()
        zero.stop()


def test_the_watchdog_beats_at_its_worlds_interval(host: TCPStore) -> None:
    from ddpkit.worker.watchdog import watcher

    client = TCPStore("127.0.0.1", host.port, is_master=False)
    dog = watcher.start(rank=1, world_size=4096, bound_s=60.0, store=client)
    try:
        assert dog.interval_s == 1.0  # its judge samples as before
        assert dog.link.beat_interval_s == 8.0  # 4,096 ranks: 512 beats a second in all
    finally:
        watcher.stop()


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
        address="x", clock=lambda: 0.0,  # the rounds are given their time: none is read
    )  # fmt: skip
    store.multi_set([f"beat/{rank}" for rank in range(world)], ["0"] * world)
    link._check_beats(0.0)  # the first round: every counter counts from now
    link._departed.add(9)  # rank 9 left with a marker of its own
    for now in (4.0, 8.0, 12.0):  # every rank beats, but 7 and 9 (and rank 0 itself)
        others = [f"beat/{rank}" for rank in range(10, world)]
        store.multi_set(others, [str(int(now))] * len(others))
        for rank in (1, 2, 3, 4, 5, 6, 8):
            store.add(f"beat/{rank}", 1)
        link._check_beats(now)
        named = [key for key in store.sets if key.startswith("exit/")]
        assert named == ([] if now < bound_s else ["exit/7"]), (now, named)
    # judged gone: a counter that moves again does not bring it back, nor name it twice
    store.multi_set([f"beat/{rank}" for rank in range(1, world)], ["13"] * (world - 1))
    link._check_beats(13.0)
    assert [key for key in store.sets if key.startswith("exit/")] == ["exit/7"]
    assert "stopped sending heartbeats 12 s ago" in store.get("exit/7").decode()
    # torch's store serves a call of N keys in more than linear time: read a slice at a time
    assert store.most_keys == batched.KEYS_PER_CALL


def test_a_survivor_names_a_rank_whose_counter_stands_still_rank_zero_too() -> None:
    # a failed collective's survivor waits for a name; a rank killed writes no marker: the
    # survivor reads every counter and names one that stood still for the gap (rank 0 too:
    # under torchrun's agent store the store outlives it), once, with its introduction
    from ddpkit.worker.watchdog.store import BeatJudge

    store = DictStore()
    link = StoreLink(
        store, rank=1, world_size=4, interval_s=0.25, bound_s=60.0, host_rank=None,
        address="x", clock=lambda: 0.0,
    )  # fmt: skip
    judge = BeatJudge(1, 0.55)
    assert link.silent(judge, 0.0) is None  # before rank 0 made the keys: nothing read
    store.multi_set([f"beat/{rank}" for rank in range(4)], ["0"] * 4)
    store.set("who/0", json.dumps({"host": "node0", "pid": 10, "node": "n0"}))
    assert link.silent(judge, 0.0) is None  # the first read: every counter counts from now
    for now in (0.25, 0.5):
        for rank in (2, 3):
            store.add(f"beat/{rank}", 1)
        assert link.silent(judge, now) is None  # not for the gap yet
    found = link.silent(judge, 0.6)
    assert found is not None and (found.rank, found.node) == (0, "n0"), found
    assert "node0" in found.who and "stopped sending heartbeats" in found.how
    assert link.silent(judge, 0.7) is None  # each once


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


def _prefix() -> str:
    from ddpkit.worker.watchdog import watcher
    from ddpkit.worker.watchdog.policy import KEY_PREFIX

    return f"{KEY_PREFIX}0/{watcher._PROCESS.generation}//"  # PrefixStore joins with a "/"


def test_the_watchdogs_beats_are_not_queued_behind_the_programs_store_wait(
    host: TCPStore,
) -> None:
    # a TCPStore client runs one operation at a time: on the program's own connection, a
    # training script blocked in store.wait() would hold every heartbeat (and be named dead)
    from ddpkit.worker.watchdog import watcher

    client = TCPStore("127.0.0.1", host.port, is_master=False)
    watcher.start(rank=1, world_size=2, bound_s=2.0, store=client)  # beats every 0.5 s
    beat = f"{_prefix()}beat/1"
    try:
        _wait(lambda: host.check([beat]) and int(host.get(beat)) >= 1, 10)
        waited: list[str] = []

        def program() -> None:  # waits for a key the test sets once it saw the beats go on
            client.wait(["go"], timedelta(seconds=60))
            waited.append(client.get("go").decode())

        blocked = threading.Thread(target=program)
        blocked.start()
        time.sleep(0.5)  # the program is inside its wait now
        before = int(host.get(beat))
        _wait(lambda: int(host.get(beat)) >= before + 3, 30)  # a guard, not a measure
        assert blocked.is_alive() and not waited  # the beats went on while it waited
        host.set("go", "1")
        blocked.join(30)
        assert waited == ["1"], "the program's wait did not end at its key"
    finally:
        watcher.stop()


def _serve_store(out: Any) -> None:
    """A forked process that hosts a store, sends its port on ``out``, and waits."""
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out.send(host.port)
    time.sleep(120)
    del host


def _store_host() -> tuple[BaseProcess, int]:
    """A store's host in a process of its own (one this test can freeze or end), its port:
    forked from the fork server of tests.support.distutil (torch imported once there), not a
    new interpreter that imports torch again."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    ours, theirs = context.Pipe()
    host = context.Process(target=_serve_store, args=(theirs,), daemon=True)
    host.start()
    assert ours.poll(120), "the store's host did not start"
    return host, int(ours.recv())


@contextlib.contextmanager
def _frozen_host() -> Any:
    """A client of a store host that froze (SIGSTOP: it accepts, never answers), its port."""
    import os
    import signal

    host, port = _store_host()
    client = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    try:
        yield host, client
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(host.pid, signal.SIGKILL)
        host.join(10)


def _freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (the signal is delivered asynchronously)."""
    import os
    import signal

    os.kill(pid, signal.SIGSTOP)
    _wait(lambda: Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "T", 10)


def _in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(work())
        except Exception as error:
            box.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_each_store_operation_of_the_watchdog_is_bounded_by_its_timeout() -> None:
    # torch's own timeout bounds waits for a key only: an add to a frozen host blocked for
    # good, and the watchdog's exit could not be bounded. Its own connection's socket times out

    from ddpkit.worker.rendezvous.store import own_connection

    with _frozen_host() as (host, client):
        own = own_connection(PrefixStore("default_pg", client), "w/", 1.0)
        assert own is not None
        own.store.add("beat/1", 1)
        _freeze(host.pid)
        thread, box = _in_thread(lambda: own.store.add("beat/1", 1))
        thread.join(30)  # within its 1 s (a generous margin: no wall-clock test)
        assert not thread.is_alive(), "an add to a frozen host was not bounded"
        assert isinstance(box[0], dist.DistError), box
        link = StoreLink(
            own.store, rank=1, world_size=2, interval_s=0.25, bound_s=2.0, host_rank=0,
            address=f"127.0.0.1:{host.pid}", clock=time.monotonic, op_timeout_s=1.0,
            closed=own.closed,
        )  # fmt: skip
        thread, _ = _in_thread(lambda: [link.step(time.monotonic() + s) for s in (0.0, 1.0)])
        thread.join(30)
        gone = link.failure
        assert gone is not None and gone.rank == 0, gone
        assert "stopped answering" in gone.how and "probably exited, froze" in gone.how


def test_the_exit_cuts_a_store_call_in_flight() -> None:
    # the exit waits an operation's timeout for the thread, then shuts its socket down: the
    # call returns at once, before the interpreter finalizes (which it would abort)

    from ddpkit.worker.rendezvous.store import own_connection

    with _frozen_host() as (host, client):
        own = own_connection(PrefixStore("default_pg", client), "w/", 600.0)
        assert own is not None
        _freeze(host.pid)
        thread, box = _in_thread(lambda: own.store.add("beat/1", 1))
        time.sleep(0.3)
        assert thread.is_alive()  # inside torch's call, for up to 600 s
        own.cut()
        thread.join(30)
        assert not thread.is_alive() and isinstance(box[0], dist.DistError), box


def test_a_store_host_that_left_is_named_without_a_failed_operation(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # a peer of rank 0 (the host) that exits first learns it from the closed connection, with
    # no store call that fails (torch logs each with a C++ stack trace on stderr)
    from ddpkit.worker.rendezvous.store import own_connection

    host, port = _store_host()
    try:
        client = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
        own = own_connection(PrefixStore("default_pg", client), "w/", 5.0)
        assert own is not None
        link = StoreLink(
            own.store, rank=1, world_size=2, interval_s=0.25, bound_s=10.0, host_rank=0,
            address=f"127.0.0.1:{port}", clock=time.monotonic, op_timeout_s=5.0,
            closed=own.closed,
        )  # fmt: skip
        link.step(time.monotonic() + 1.0)  # introduced, beat, polled
        assert link.failure is None and not own.closed()
    finally:
        host.kill()
        host.join(10)
    _wait(own.closed, 10)
    link.step(time.monotonic() + 2.0)
    link.leave({"how": "exited"})
    gone = link.failure
    assert gone is not None and "closed by the store's host" in gone.how, gone
    assert "TCPStore" not in capfd.readouterr().err


EXIT_AS_HOST_GOES = """
import os, signal, sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from ddpkit.worker.watchdog import watcher
port, pid, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
client = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
dog = watcher.start(rank=1, world_size=2, bound_s=float(sys.argv[4]), store=client)
time.sleep(0.72)  # it beats (and polls) at once, then every 0.5 s


def state():
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X"


# a signal is delivered when the kernel gets to it: wait until the host is stopped, or dead
# (its sockets closed), before the exit (at a load of 20, an exit 0.4 s after the SIGKILL
# still met the host alive and its marker's write got "Connection reset by peer", logged)
wanted = {"frozen": "T", "gone": "ZX"}.get(how)
if wanted:
    os.kill(pid, signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
    guard = time.monotonic() + 30
    while state() not in wanted and time.monotonic() < guard:
        time.sleep(0.01)
time.sleep(0.4)  # its next beat: into a frozen host, or none (the host is gone)
print("started", flush=True)
"""  # and the program ends: the exit stops the thread, within 2 x T, and writes the marker


@pytest.mark.multiproc
@pytest.mark.parametrize(("how", "bound_s"), [("live", 2.0), ("frozen", 2.0), ("frozen", 60.0),
                                              ("gone", 2.0)])  # fmt: skip
def test_a_rank_ends_with_its_own_code_whatever_its_store_host_does(
    tmp_path: Path, how: str, bound_s: float
) -> None:
    # a daemon thread that returns from torch's C++ code while the interpreter finalizes aborts
    # the process ("terminate called without an active exception", SIGABRT): the exit stops
    # the watchdog's thread first, waiting T = min(10 s, bound / 2) at most (at 60 s: T = 10 s,
    # so the call into the frozen host is cut), and the exit is the program's own
    from tests.support.spawned import child_env

    script = tmp_path / "exit_as_host_goes.py"
    script.write_text(EXIT_AS_HOST_GOES)
    host, port = _store_host()
    try:
        done = subprocess.run(
            [sys.executable, str(script), str(port), str(host.pid), how, str(bound_s)],
            env=child_env(), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        marked = how == "live" and _fresh(port).check(["ddpkit/watchdog/0/1//exit/1"])
    finally:
        host.kill()
        host.join(10)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    assert done.stdout.rstrip().endswith("started"), tail
    assert "terminate called" not in done.stderr, tail
    assert "TCPStore" not in done.stderr or how == "frozen", tail  # a timeout is logged
    assert marked or how != "live", "a live host got no exit marker"


def _fresh(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
