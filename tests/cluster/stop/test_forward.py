"""The relay's bookkeeping outside a ddpkit job (``catching_only``), without processes.

A stop signal sent to ``ddpkit run`` is owed to the workers running when it came (or to the
next ones, once two looks in a row find the same ones: torch starts a group's workers one by
one); each gets it once it catches it (``SigCgt`` in ``/proc/<pid>/status``), one that ends
owing it drops it. The real runs are tests/launch/test_run_signal_mask.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ddpkit.cluster.stop import forward

USR2_BIT = 1 << (signal.SIGUSR2 - 1)


def _status(
    proc: Path, pid: int, *, state: str = "S", ppid: int | None = None, caught: int = 0
) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    parent = os.getpid() if ppid is None else ppid
    (proc / str(pid) / "status").write_text(
        f"Name:\tpython\nState:\t{state} (sleeping)\nPPid:\t{parent}\n"
        f"SigBlk:\t0000000000000000\nSigIgn:\t0000000001001000\nSigCgt:\t{caught:016x}\n"
    )


def test_catches_reads_the_bit_of_the_signal_in_sigcgt(tmp_path: Path) -> None:
    _status(tmp_path, 10, caught=USR2_BIT | 2)
    _status(tmp_path, 11, caught=2 | (1 << (signal.SIGUSR1 - 1)))
    assert forward.catches(10, signal.SIGUSR2, proc=str(tmp_path)) is True
    assert forward.catches(11, signal.SIGUSR2, proc=str(tmp_path)) is False


@pytest.mark.parametrize("how", ["gone", "zombie", "dead", "not-a-child", "garbled"])
def test_catches_is_none_for_what_is_no_running_child(tmp_path: Path, how: str) -> None:
    if how == "zombie":
        _status(tmp_path, 10, state="Z", caught=USR2_BIT)
    elif how == "dead":
        _status(tmp_path, 10, state="X", caught=USR2_BIT)
    elif how == "not-a-child":
        _status(tmp_path, 10, ppid=1, caught=USR2_BIT)
    elif how == "garbled":
        (tmp_path / "10").mkdir()
        (tmp_path / "10" / "status").write_text("Name:\tpython\nState:\tS\n")
    assert forward.catches(10, signal.SIGUSR2, proc=str(tmp_path)) is None


def test_workers_are_the_running_children_that_exec_d_and_are_no_helpers(tmp_path: Path) -> None:
    me = os.getpid()
    children = {  # pid: (state, command line)
        10: ("S", b"python\0-u\0train.py\0"),
        11: ("S", b"python\0-m\0ddpkit\0run\0train.py\0"),  # forked, not exec'd: ours
        12: ("Z", b""),
        13: ("S", b"python\0-c\0from multiprocessing.resource_tracker import main\0"),
    }
    for pid, (state, argv) in {me: ("R", children[11][1]), **children}.items():
        (tmp_path / str(pid)).mkdir()
        parent = 1 if pid == me else me
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python) {state} {parent} 1 1 0\n")
        (tmp_path / str(pid) / "cmdline").write_bytes(argv)
    assert forward.workers(proc=str(tmp_path)) == [10]
    (tmp_path / "11" / "cmdline").write_bytes(b"python\0-u\0train.py\0")  # now exec'd
    assert forward.workers(proc=str(tmp_path)) == [10, 11]


class _Workers:
    """Stands in for /proc: the running workers, which of them catch the signal, what was sent."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.running: list[int] = []
        self.catching: set[int] = set()
        self.sent: list[int] = []
        monkeypatch.setattr(forward, "workers", lambda: list(self.running))
        monkeypatch.setattr(
            forward,
            "catches",
            lambda pid, sig: (pid in self.catching) if pid in self.running else None,
        )
        monkeypatch.setattr(forward, "_send", self._send)

    def _send(self, signum: int, pids: list[int]) -> bool:
        self.sent.extend(pids)
        return bool(pids)


def test_a_kept_arrival_waits_for_a_whole_group_then_for_each_worker_to_catch_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    procs = _Workers(monkeypatch)
    owing = forward._Owing(signal.SIGUSR2)
    owing.kept = True
    assert not owing.pass_on() and owing.kept  # no worker yet: kept, nothing changed (backoff)
    procs.running = [10]
    assert owing.pass_on() and owing.kept  # the group is starting: not owed yet
    procs.running = [10, 11]
    assert owing.pass_on() and owing.kept
    assert owing.pass_on() and not owing.kept and owing.owed == {10, 11}  # the same twice
    assert not owing.pass_on() and procs.sent == []  # neither catches it: kept for both
    procs.catching = {11}
    assert owing.pass_on() and procs.sent == [11] and owing.owed == {10}
    assert not owing.pass_on() and procs.sent == [11]  # sent once
    procs.running = [11]  # 10 ended owing it: dropped, never sent
    assert owing.pass_on() and not owing.busy() and procs.sent == [11]


def test_an_arrival_is_owed_to_the_workers_running_then_not_to_the_next_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    procs = _Workers(monkeypatch)
    procs.running = [10, 11]
    owing = forward._Owing(signal.SIGUSR2)
    owing.kept = True
    owing.pass_on()
    owing.pass_on()
    assert owing.owed == {10, 11}
    procs.running = [20, 21]  # a restarted group: the first ended without catching it
    procs.catching = {20, 21}
    owing.pass_on()
    assert not owing.busy() and procs.sent == []


def test_an_arrival_during_a_forward_joins_it_instead_of_nesting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python runs a handler between any two bytecodes, the running handler's too: a storm of
    SIGUSR1 faster than one scan of /proc nested forward_now in itself until a RecursionError
    ended ``ddpkit run`` (tests/launch/test_run_signals.py, on a loaded machine). Here every
    scan meets an arrival, as in that storm."""
    sent: list[tuple[int, list[int]]] = []
    scans = [0]

    def scan() -> list[int]:
        scans[0] += 1
        if scans[0] < 5000:  # an arrival in the middle of the scan
            forward.forward_now(signal.SIGUSR1, None)
        return [4242]

    monkeypatch.setattr(forward, "workers", scan)
    monkeypatch.setattr(forward, "_send", lambda signum, pids: sent.append((signum, pids)))
    forward.forward_now(signal.SIGUSR1, None)
    assert scans[0] == 1 and sent == [(signal.SIGUSR1, [4242])]
    forward.forward_now(signal.SIGUSR1, None)  # the next arrival, after it: a forward of its own
    assert len(sent) == 2


def test_another_signal_during_a_forward_is_still_passed_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only an arrival of the signal being forwarded joins it: a SIGTERM in the middle of a
    SIGUSR1's forward is a signal of its own, and goes on to the workers."""
    sent: list[tuple[int, list[int]]] = []
    scans = [0]

    def scan() -> list[int]:
        scans[0] += 1
        if scans[0] == 1:
            forward.forward_now(signal.SIGTERM, None)
        return [4242]

    monkeypatch.setattr(forward, "workers", scan)
    monkeypatch.setattr(forward, "_send", lambda signum, pids: sent.append((signum, pids)))
    forward.forward_now(signal.SIGUSR1, None)
    assert sent == [(signal.SIGTERM, [4242]), (signal.SIGUSR1, [4242])]
