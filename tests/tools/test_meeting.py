"""The doctor's meeting: how a rank other than 0 waits for rank 0's verdict on a real store.

Every rank but 0 waits there while rank 0 waits for the last rank to arrive (up to the doctor's
timeout), so what one waiting rank costs the store, times the world size, is the meeting's
load on rank 0's one store thread: a wait the store answers, not a poll.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from ddpkit.tools.doctor_checks import Check
from ddpkit.tools.meeting import WAIT_THREAD, Meeting
from ddpkit.worker.rendezvous import waits
from tests.support.distutil import CountingStore


@pytest.fixture
def host() -> Iterator[Any]:
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    yield store
    del store


def _waiter(host: Any, world: int = 4096) -> tuple[Meeting, CountingStore]:
    client = TCPStore("127.0.0.1", host.port, None, False)
    counted = CountingStore(PrefixStore("ddpkit-doctor/run/0", client))
    ok = Check("PASS", "master", "ok")
    return Meeting(counted, ok, 7, world, 5.0), counted  # type: ignore[arg-type]


@pytest.mark.parametrize("after_s", [None, 0.0, 0.05, 0.3, 1.5])
def test_a_rank_waits_for_the_verdict_in_two_store_calls_however_long_it_comes(
    host: Any, after_s: float | None
) -> None:
    """None: the verdict was set before the rank asked. A poll every 0.1 s made ~15 calls for a
    verdict 1.5 s late, times every rank of the job, all at rank 0's store."""
    met, counted = _waiter(host)
    verdict = PrefixStore("ddpkit-doctor/run/0", host)
    if after_s is None:
        verdict.set("verdict", "fail")
    else:
        threading.Timer(after_s, verdict.set, ("verdict", "fail")).start()
    assert met.wait_for("verdict", 10.0) == "fail"
    assert counted.calls == {"wait": 1, "get": 1}


@pytest.mark.parametrize("bound_s", [0.2, 1.0])
def test_a_verdict_that_never_comes_is_none_at_the_bound_and_the_store_still_answers(
    host: Any, bound_s: float
) -> None:
    met, counted = _waiter(host)
    started = time.monotonic()
    assert met.wait_for("verdict", bound_s) is None
    took = time.monotonic() - started
    assert bound_s * 0.9 <= took < bound_s + 5.0, took
    assert counted.calls["wait"] == 1 and "get" not in counted.calls
    # torch cancels the timed-out wait with the store: the connection's next answers are its own
    assert int(met.store.add("done", 1)) == 1
    PrefixStore("ddpkit-doctor/run/0", host).set("verdict", "ok")
    assert met.wait_for("verdict", 1.0) == "ok"


def _host_then_die(port_to: Any, die_after_s: float) -> None:
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port_to.put(store.port)
    time.sleep(die_after_s)  # then the process ends: its store goes with it


@pytest.mark.parametrize("die_after_s", [0.1, 0.8])
def test_rank_zero_gone_during_the_wait_is_an_error_at_once_not_a_wait_to_the_bound(
    die_after_s: float,
) -> None:
    ctx = mp.get_context("spawn")
    port_to = ctx.Queue()
    child = ctx.Process(target=_host_then_die, args=(port_to, die_after_s))
    child.start()
    try:
        port = port_to.get(timeout=60)
        client = TCPStore("127.0.0.1", port, None, False)
        met = Meeting(client, Check("PASS", "master", "ok"), 3, 4, 5.0)
        started = time.monotonic()
        with pytest.raises(dist.DistError):
            met.wait_for("verdict", 30.0)
        assert time.monotonic() - started < 20.0  # the host's end, not the 30 s bound
    finally:
        child.kill()
        child.join(10)


@pytest.mark.parametrize("after_s", [0.3, 1.0, 2.0])
def test_ctrl_c_ends_a_rank_waiting_for_the_verdict_at_once(host: Any, after_s: float) -> None:
    """torch's wait holds its thread in C++ (a signal's handler runs when it returns): the wait
    runs in a thread of its own, and Ctrl-C still ends the rank now, not at the 30 s bound.
    (The signal comes once the wait has begun: microseconds after the call, 0.3 s at least.)"""
    met, _ = _waiter(host)
    timer = threading.Timer(after_s, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        timer.start()  # inside: Thread.start waits for the timer's thread, interruptible too
        met.wait_for("verdict", 30.0)
    assert time.monotonic() - started < 10.0
    assert waits.running(WAIT_THREAD) == 1  # still in torch's wait, waited for a little at exit
    PrefixStore("ddpkit-doctor/run/0", host).set("verdict", "ok")  # which then ends
    deadline = time.monotonic() + 10
    while waits.running(WAIT_THREAD) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waits.running(WAIT_THREAD) == 0
