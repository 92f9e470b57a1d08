"""The doctor's meeting: how a rank other than 0 waits for rank 0's verdict on a real store.

Every rank but 0 waits there while rank 0 waits for the last rank to arrive (up to the doctor's
timeout), so what one waiting rank costs the store, times the world size, is the meeting's
load on rank 0's one store thread: a wait the store answers, not a poll.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from ddpkit.tools.doctor_checks import Check
from ddpkit.tools.meeting import Meeting
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
    assert took >= bound_s * 0.9, took  # it waited to the bound (a hang: pytest's timeout)
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
    ctx = mp.get_context("forkserver")  # run_workers' server: torch imported once, not per host
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    port_to = ctx.Queue()
    child = ctx.Process(target=_host_then_die, args=(port_to, die_after_s))
    child.start()
    try:
        port = port_to.get(timeout=60)
        client = TCPStore("127.0.0.1", port, None, False)
        met = Meeting(client, Check("PASS", "master", "ok"), 3, 4, 5.0)
        # an error, the host's end: at the 30 s bound the wait would return None instead
        with pytest.raises(dist.DistError):
            met.wait_for("verdict", 30.0)
    finally:
        child.kill()
        child.join(10)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_rank_zero_leaves_at_once_and_a_finished_one_waits_for_the_others(
    host: Any, interrupt: type[BaseException]
) -> None:
    """The others wait for the verdict in torch's C++ code, where a Ctrl-C reaches them only
    when the wait ends: an interrupted rank 0 does not keep its store up for their "done" (30 s
    here), so the store closes and their waits end at once (the test above)."""
    store = PrefixStore("ddpkit-doctor/run/0", host)
    counted = CountingStore(store)
    met = Meeting(counted, Check("PASS", "master", "ok"), 0, 4, 30.0)  # type: ignore[arg-type]
    with pytest.raises(interrupt), met.store_closing():
        raise interrupt("Ctrl-C")
    assert counted.calls == {"add": 1}  # it said it is done, and polled nobody's
    assert int(store.add("done", 0)) == 1
    counted = CountingStore(store)
    finished = Meeting(counted, Check("PASS", "master", "ok"), 0, 4, 1.0)  # type: ignore[arg-type]
    started = time.monotonic()
    with finished.store_closing():
        pass
    assert time.monotonic() - started >= 0.9  # the 3 others never said done: the 1 s bound
    assert counted.calls["add"] > 2, counted.calls  # polled the others' "done" meanwhile
