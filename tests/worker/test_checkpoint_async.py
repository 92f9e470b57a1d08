"""Checkpoints written in the background, one process: what is written is the state at the
save (whatever the loop does after), one write at a time, bounded waits, a kill -9 mid-write.

The write is held at a chosen moment through the module's seam (``asyncsave.save_payload``,
wrapped to wait on an event) or, in a killed writer process, by a value whose pickling pauses;
the file, the thread and the loads are real.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpkit
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.worker import asyncsave, durable, inflight

_WAIT_S = 60.0  # bounds every wait of a test on a loaded machine; never reached when it works


def _names(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir())


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, optimizer)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(5, 6)).square().sum().backward()
    optimizer.step()  # in place: the weights and Adam's moments


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    return {key: asyncsave.snapshot(value.state_dict()) for key, value in state.items()}


def _same(one: Any, other: Any) -> bool:
    if isinstance(one, torch.Tensor):
        return isinstance(other, torch.Tensor) and torch.equal(one, other)
    if isinstance(one, dict):
        return one.keys() == other.keys() and all(_same(one[k], other[k]) for k in one)
    if isinstance(one, list | tuple):
        return len(one) == len(other) and all(map(_same, one, other))
    return bool(one == other)


class _Held:
    """The seam: the background write waits at ``where`` ("start": before anything is written,
    "middle": in torch.save, with the temporary file open and part of the data written) until
    released; ``entered`` is set when it gets there."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0
        real_save, real_write = asyncsave.save_payload, durable._StreamingFile.write

        def save(*args: Any) -> Path:
            self.calls += 1
            if where == "start":
                self._hold()
            return real_save(*args)

        def write(stream: Any, data: Any) -> int:
            count = real_write(stream, data)
            if where == "middle" and threading.current_thread() is not threading.main_thread():
                self._hold()
            return count

        monkeypatch.setattr(asyncsave, "save_payload", save)
        monkeypatch.setattr(durable._StreamingFile, "write", write)

    def _hold(self) -> None:
        self.entered.set()
        assert self.release.wait(_WAIT_S), "the test never released the write"


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], _Held]]:
    made: list[_Held] = []

    def make(where: str) -> _Held:
        made.append(_Held(monkeypatch, where))
        return made[-1]

    yield make
    for each in made:
        each.release.set()
    if inflight.in_flight():  # no write may outlive its test
        with pytest.raises(CheckpointError) if _failed() else contextlib.nullcontext():
            ddpkit.wait_for_checkpoint(timeout_s=_WAIT_S)
    assert not inflight.in_flight()


def _failed() -> bool:
    pending = inflight._STATE.pending
    return pending is not None and pending.done.wait(_WAIT_S) and pending.error is not None


# --- what is written is the state at the save --------------------------------------------------


@pytest.mark.parametrize("moment", ["returned", "start", "middle"])
def test_later_in_place_steps_do_not_reach_the_file(
    tmp_path: Path, held: Callable[[str], _Held], moment: str
) -> None:
    """The loop steps the optimizer (in place) right after the save returns, while the write
    waits to begin, and while it is half written: the file holds the state at the save."""
    model, optimizer = _trained(0)
    state = {"model": model, "optimizer": optimizer}
    if moment == "returned":
        pending = ddpkit.async_save_checkpoint(tmp_path, state, step=1)
        expected = None
    else:
        hold = held(moment)
        expected = _copy(state)
        pending = ddpkit.async_save_checkpoint(tmp_path, state, step=1)
        assert hold.entered.wait(_WAIT_S), "the write never started"
    before = _copy(state) if expected is None else expected
    for _ in range(3):
        _step(model, optimizer)
    if moment != "returned":
        hold.release.set()
    assert pending.wait() == tmp_path / "ckpt-000000001-000000001.pt"
    assert not _same(_copy(state)["model"], before["model"])  # the steps did change it
    loaded: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(tmp_path, loaded) == 1
    assert _same(loaded["model"], before["model"])
    assert _same(loaded["optimizer"], before["optimizer"])


def test_tied_tensors_stay_one_and_types_are_kept(tmp_path: Path) -> None:
    shared = torch.arange(4.0)
    param = torch.nn.Parameter(torch.ones(2))
    state = {"a": shared, "b": shared, "p": param, "t": (1, "x", [shared]), "n": None}
    copied = asyncsave.snapshot(state)
    assert copied["a"] is copied["b"] is copied["t"][2][0] and copied["a"] is not shared
    assert type(copied["p"]) is torch.nn.Parameter and copied["p"].requires_grad
    ddpkit.async_save_checkpoint(tmp_path, state, step=1).wait()
    loaded: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(tmp_path, loaded) == 1  # weights_only: nothing refused
    assert torch.equal(loaded["a"], shared) and loaded["t"][:2] == (1, "x")


def test_each_save_holds_its_own_state_when_the_copy_memory_is_reused(tmp_path: Path) -> None:
    """From the second save on the copy reuses the previous copy's memory (its write is over):
    every file still holds the state of its own save."""
    model, optimizer = _trained(1)
    state = {"model": model, "optimizer": optimizer}
    expected = {}
    for step in range(1, 4):
        expected[step] = _copy(state)
        ddpkit.async_save_checkpoint(tmp_path, state, step=step, keep_last=3)
        _step(model, optimizer)
    ddpkit.wait_for_checkpoint()
    for step, saved in expected.items():
        loaded: dict[str, Any] = {}
        assert ddpkit.load_checkpoint(tmp_path / f"ckpt-{step:09d}-{step:09d}.pt", loaded) == step
        assert _same(loaded["model"], saved["model"]), step
        assert _same(loaded["optimizer"], saved["optimizer"]), step


def test_a_spare_is_reused_only_where_it_fits_and_once() -> None:
    first = asyncsave.snapshot({"a": torch.ones(3), "b": [torch.ones(2, 2)]})
    a, b = torch.arange(3.0), torch.arange(4.0).reshape(2, 2)
    again = asyncsave.snapshot({"a": a, "b": [b]}, first)
    assert again["a"] is first["a"] and again["b"][0] is first["b"][0]  # the memory reused
    assert torch.equal(again["a"], a) and torch.equal(again["b"][0], b)
    tied = torch.ones(3)
    spare = asyncsave.snapshot({"x": tied, "y": tied})  # one tensor at two places
    x, y = torch.zeros(3), torch.full((3,), 2.0)
    copied = asyncsave.snapshot({"x": x, "y": y}, spare)  # now two: two buffers
    assert torch.equal(copied["x"], x) and torch.equal(copied["y"], y)
    other = asyncsave.snapshot({"a": torch.ones(4), "b": [b.double()]}, first)  # misfits
    assert other["a"] is not first["a"] and other["b"][0].dtype == torch.float64


# --- at most one write in flight ---------------------------------------------------------------


@pytest.mark.parametrize("then", ["async", "sync", "load"])
def test_the_next_save_or_load_waits_for_the_write_in_flight(
    tmp_path: Path, held: Callable[[str], _Held], then: str
) -> None:
    hold = held("start")
    first = ddpkit.async_save_checkpoint(tmp_path, {"w": torch.ones(2)}, step=1)
    assert hold.entered.wait(_WAIT_S)
    results: list[Any] = []

    def next_call() -> None:
        if then == "load":
            results.append(ddpkit.load_checkpoint(tmp_path, {}))
        elif then == "sync":
            results.append(ddpkit.save_checkpoint(tmp_path, {"w": torch.zeros(2)}, step=2))
        else:
            results.append(ddpkit.async_save_checkpoint(tmp_path, {"w": torch.zeros(2)}, step=2))

    caller = threading.Thread(target=next_call)
    caller.start()
    caller.join(0.5)  # it is blocked: the first write is held
    assert caller.is_alive() and results == [] and hold.calls == 1
    assert _names(tmp_path) == []  # nothing written yet, the second save not begun
    hold.release.set()
    caller.join(_WAIT_S)
    assert not caller.is_alive() and first.done()
    if then == "load":
        assert results == [1]
        return
    if then == "async":
        results[0].wait()
    assert hold.calls == (2 if then == "async" else 1)
    assert _names(tmp_path) == ["ckpt-000000001-000000001.pt", "ckpt-000000002-000000002.pt"]
    assert ddpkit.load_checkpoint(tmp_path, {}) == 2  # written last: newest


@pytest.mark.parametrize("how", ["wait", "wait_for_checkpoint"])
def test_a_wait_past_its_bound_is_an_error_and_the_write_stays_in_flight(
    tmp_path: Path, held: Callable[[str], _Held], how: str
) -> None:
    hold = held("middle")
    pending = ddpkit.async_save_checkpoint(tmp_path, {"w": torch.ones(2**16)}, step=1)
    assert hold.entered.wait(_WAIT_S)
    wait = pending.wait if how == "wait" else ddpkit.wait_for_checkpoint
    with pytest.raises(CheckpointError, match=r"step 1 .* did not finish within 0\.2 s"):
        wait(timeout_s=0.2)
    assert inflight.in_flight() and not pending.done()
    hold.release.set()
    first = tmp_path / "ckpt-000000001-000000001.pt"
    assert wait(timeout_s=_WAIT_S) == first
    assert not inflight.in_flight() and pending.wait() == first


def test_a_failed_write_raises_at_the_next_save_and_only_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file" / "ckpt"
    (tmp_path / "a-file").write_text("not a folder")
    ddpkit.async_save_checkpoint(blocked, {"w": torch.ones(2)}, step=7)  # returns: fails later
    with pytest.raises(CheckpointError, match=r"rank 0\) failed to write checkpoint step 7") as e:
        ddpkit.async_save_checkpoint(tmp_path / "ok", {"w": torch.ones(2)}, step=8)
    assert isinstance(e.value.__cause__, NotADirectoryError | FileExistsError)
    assert not inflight.in_flight()  # the failed save is over; the one that raised never began
    assert ddpkit.async_save_checkpoint(tmp_path / "ok", {"w": torch.ones(2)}, step=8).wait()
    assert ddpkit.load_checkpoint(tmp_path / "ok", {}) == 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout_s": 0}, "timeout_s=0 must be a positive"),
        ({"timeout_s": float("inf")}, "timeout_s=inf"),
        ({"timeout_s": True}, "timeout_s=True"),
        ({"step": -1}, "step=-1"),
        ({"keep_last": 0}, "keep_last=0"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ddpkit.async_save_checkpoint(tmp_path, {}, **{"step": 1, **kwargs})
    assert not inflight.in_flight() and not list(tmp_path.glob("ckpt-*.pt"))


def test_an_uncopyable_value_raises_at_once(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="could not copy the state of checkpoint step 1"):
        ddpkit.async_save_checkpoint(tmp_path, {"lock": threading.Lock()}, step=1)
    assert not inflight.in_flight() and _names(tmp_path) == []


# --- kill -9 during the background write -------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import collections, os, sys, time
    from pathlib import Path
    import torch
    import ddpkit

    folder, marker, where = sys.argv[1], Path(sys.argv[2]), sys.argv[3]

    class Pause:
        # copied as itself; pickled inside torch.save, in the writer thread, temp file open
        def __deepcopy__(self, memo):
            return self
        def __reduce__(self):
            marker.write_text("paused")
            time.sleep(120)
            return (collections.OrderedDict, ())

    ddpkit.save_checkpoint(folder, {"w": torch.full((4,), 1.0)}, step=1)
    big = torch.randn(4 * 1024 * 1024)  # 16 MB
    first = where == "after-data"
    state = {"big": big, "mark": Pause()} if first else {"mark": Pause(), "big": big}
    ddpkit.async_save_checkpoint(folder, state, step=2)
    while True:  # the loop trains on
        big.mul_(1.0001)
    """
)


@pytest.mark.parametrize("where", ["before-data", "after-data"])
def test_kill_9_during_the_background_write_keeps_the_previous_checkpoint(
    tmp_path: Path, where: str
) -> None:
    folder, marker = tmp_path / "ckpt", tmp_path / "marker"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(folder), str(marker), where])
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert writer.poll() is None, f"writer exited early with {writer.returncode}"
            assert time.monotonic() < deadline, "the writer never reached the background write"
            time.sleep(0.05)
        (temp,) = [name for name in _names(folder) if name.endswith(".tmp")]
        assert temp.startswith(".ckpt-000000002-000000002.pt.")
        os.kill(writer.pid, signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    state: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(folder, state) == 1
    assert torch.equal(state["w"], torch.full((4,), 1.0))
    dead_since = time.time() - durable.BEAT_STALE_AFTER_S - 60  # the time a restart takes
    os.utime(folder / temp, (dead_since, dead_since))
    ddpkit.async_save_checkpoint(folder, {"w": torch.zeros(1)}, step=3).wait()
    assert _names(folder) == ["ckpt-000000001-000000001.pt", "ckpt-000000003-000000002.pt"]


def test_the_writer_thread_yields_the_cpu_to_the_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write runs at a lower CPU priority than the loop (its own thread's nice value)."""
    seen: list[int] = []
    real = asyncsave.save_payload

    def save(*args: Any) -> Path:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(*args)

    monkeypatch.setattr(asyncsave, "save_payload", save)
    ddpkit.async_save_checkpoint(tmp_path, {"w": torch.ones(2)}, step=1).wait()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [min(19, mine + inflight._NICER)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # loop untouched
