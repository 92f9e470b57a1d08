"""Bounded calls: a call's thread, its outcome within the bound, and a forked child."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ddpkit.worker.rendezvous import waits
from ddpkit.worker.rendezvous.waits import Call, CallThread, bounded, running


def test_a_call_thread_runs_once_is_counted_by_name_and_joined() -> None:
    name = f"test-call-thread-{time.monotonic_ns()}"
    go, ran = threading.Event(), []
    thread = CallThread(lambda: (go.wait(10), ran.append(threading.get_ident())), name)
    assert thread.is_alive() and running(name) == 1
    thread.join(0.05)  # a bounded join of a thread still held returns, alive
    assert thread.is_alive() and running(name) == 1
    go.set()
    thread.join(10)
    assert not thread.is_alive() and running(name) == 0
    assert ran and ran[0] != threading.get_ident()  # on a thread of its own


def test_a_call_that_raises_still_ends_its_thread() -> None:
    name = f"test-call-raises-{time.monotonic_ns()}"

    def fail() -> None:
        raise ValueError("refused")

    call = Call(fail, name)
    assert call.wake.wait(10)
    outcome = call.give_up()
    assert isinstance(outcome.error, ValueError) and outcome.pending is None
    deadline = time.monotonic() + 10
    while running(name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running(name) == 0


def test_bounded_gives_up_on_a_call_that_outlives_its_bound_and_holds_it_for_the_exit() -> None:
    name = f"test-bounded-{time.monotonic_ns()}"
    release = threading.Event()
    before = len(waits._PENDING)
    try:
        started = time.monotonic()
        outcome = bounded(lambda: release.wait(30), 0.2, name)
        assert 0.2 <= time.monotonic() - started < 5
        assert outcome.value is None and outcome.error is None
        assert outcome.pending is not None and outcome.pending.is_alive()
        assert len(waits._PENDING) == before + 1 and running(name) == 1
    finally:
        release.set()
    assert outcome.pending is not None
    outcome.pending.join(10)
    assert not outcome.pending.is_alive() and running(name) == 0
    assert bounded(lambda: 7, 10, name).value == 7


def test_a_child_forked_while_a_call_runs_neither_sees_it_alive_nor_waits_for_it() -> None:
    name = f"test-forked-{time.monotonic_ns()}"
    release = threading.Event()
    outcome = bounded(lambda: release.wait(30), 0.05, name)
    assert outcome.pending is not None and running(name) == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread does not exist here
        try:
            started = time.monotonic()
            waits._wait_for_pending()  # what its exit would wait for: nothing
            outcome.pending.join(5)
            ok = (
                not outcome.pending.is_alive()
                and running(name) == 0
                and not waits._PENDING
                and time.monotonic() - started < 1
            )
            os.write(write, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 2)
        os.waitpid(pid, 0)
        alive_here = outcome.pending.is_alive() and running(name) == 1  # still, in the parent
    finally:
        os.close(read)
        release.set()
    assert answer == b"ok" and alive_here
    outcome.pending.join(10)
    assert not outcome.pending.is_alive() and running(name) == 0


def test_a_thread_that_cannot_start_leaves_nothing_counted_or_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"test-no-thread-{time.monotonic_ns()}"

    def refuse(*_: object) -> int:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(waits._thread, "start_new_thread", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        CallThread(lambda: None, name)
    assert running(name) == 0 and name not in waits._RUNNING.counts
