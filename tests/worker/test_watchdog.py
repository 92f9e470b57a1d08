"""The peer watchdog: survivors of a rank that leaves end within the bound, naming it.

Pure pieces (configuration, messages, the blocked-thread check) run in-process. The scenarios
start real processes (gloo on 127.0.0.1): ``forked`` (tests/support/spawned.py) forks one
process per rank from the fork server (torch imported once), each running the worker script as
``__main__`` with torchrun's variables in its own environment, its own stdout, stderr and exit
code, and ending as an interpreter does; one test goes through ``python -m ddpkit run`` with
fresh interpreters. No test times an ending (on this loaded 2-core machine a start of three
ranks alone took up to 20 s): a survivor ending on its own, with the watchdog's exit code and
its message naming the bound, before the guard of ``forked`` or of ``subprocess.run`` kills it,
shows that nothing waited for the 30-minute collective timeout.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import ddpkit
from ddpkit.cluster.stop.blamed import take_blamed
from ddpkit.errors import ConfigError
from ddpkit.worker import context as runtime
from ddpkit.worker import process_group, watchdog
from ddpkit.worker.watchdog import policy, watcher
from ddpkit.worker.watchdog.policy import Departure, read_marker, read_who
from ddpkit.worker.watchdog.store import BeatJudge
from tests.support.distutil import free_port, run_workers, torchrun_env
from tests.support.pids import signal_if_same, start_ticks
from tests.support.spawned import Rank, forked
from tests.support.spawned import child_env as _child_env
from tests.support.spawned import running as _running

ROOT = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()

# Rank --leave-rank leaves after --steps all_reduces; the others all_reduce on, or work alone.
WORKER = """
import argparse, os, signal, sys, time
import torch
import torch.distributed as dist
import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("--leave", choices=["return", "raise", "kill", "freeze"], default="return")
parser.add_argument("--leave-rank", type=int, default=1)
parser.add_argument("--solo-s", type=float, default=0.0)
parser.add_argument("--solo-call-s", type=float, default=0.0)
parser.add_argument("--children", action="store_true")
parser.add_argument("--slurm-node-names", action="store_true")  # SLURM's n<rank>, job 42
opts = parser.parse_args()

if opts.slurm_node_names:
    os.environ["SLURMD_NODENAME"] = f"n{os.environ['RANK']}"
ctx = ddpkit.init()
if opts.slurm_node_names:  # after init: detection must not take this for a SLURM step
    os.environ["SLURM_JOB_ID"] = "42"
print(f"pid {ctx.rank} {os.getpid()}", flush=True)


def nap():  # a child that outlives its parent unless someone ends it
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    time.sleep(120)


if opts.children and ctx.rank != opts.leave_rank:  # 2 data loader workers, 1 plain child
    import multiprocessing
    from torch.utils.data import DataLoader
    batches = iter(DataLoader(list(range(1000)), batch_size=2, num_workers=2))
    next(batches)
    sleeper = multiprocessing.get_context("fork").Process(target=nap)
    sleeper.start()
    pids = [worker.pid for worker in batches._workers] + [sleeper.pid]
    # with each start time (/proc/<pid>/stat field 22): after they end, a pid may name another
    # process, which the test must never kill
    ticks = [open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19] for pid in pids]
    print("children " + " ".join(f"{pid}:{t}" for pid, t in zip(pids, ticks)), flush=True)
value = torch.ones(1)
for _ in range(3):
    dist.all_reduce(value)
if ctx.rank == opts.leave_rank:
    print(f"leaving {time.time():.3f}", flush=True)  # wall clock: the test times from here
    if opts.leave == "raise":
        raise ValueError(f"boom from rank {ctx.rank}")
    if opts.leave == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if opts.leave == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    sys.exit(0)
if opts.solo_s:  # work alone after the peer finished: short sleeps and computations
    deadline = time.monotonic() + opts.solo_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        sum(range(5000))
    print("solo done", flush=True)
if opts.solo_call_s:  # one long call of its own after the peer finished: blocked, no collective
    time.sleep(opts.solo_call_s)
    print("solo call done", flush=True)
if opts.solo_s or opts.solo_call_s:
    sys.exit(0)
while True:
    dist.all_reduce(value)
"""


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "explicit", "expected"),
    [
        ({}, None, 60.0),
        ({"DDPKIT_PEER_TIMEOUT": "5"}, None, 5.0),
        ({"DDPKIT_PEER_TIMEOUT": " 2.5 "}, None, 2.5),
        ({"DDPKIT_PEER_TIMEOUT": "off"}, None, None),
        ({"DDPKIT_PEER_TIMEOUT": "OFF"}, None, None),
        ({"DDPKIT_PEER_TIMEOUT": "0"}, None, None),
        ({"DDPKIT_PEER_TIMEOUT": ""}, None, 60.0),
        ({"DDPKIT_PEER_TIMEOUT": "off"}, 7, 7.0),  # the keyword wins
        ({}, 0, None),
    ],
)
def test_peer_timeout_resolution(
    env: dict[str, str], explicit: float | None, expected: float | None
) -> None:
    assert policy.peer_timeout(env, explicit) == expected


@pytest.mark.parametrize("raw", ["soon", "-1", "inf", "nan", "1e400"])
def test_bad_peer_timeout_variable_is_a_config_error(raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"DDPKIT_PEER_TIMEOUT='{re.escape(raw)}'") as info:
        policy.peer_timeout({"DDPKIT_PEER_TIMEOUT": raw}, None)
    assert "off" in str(info.value.hint)


@pytest.mark.parametrize("value", [-1.0, True, float("inf")])
def test_bad_peer_timeout_keyword_is_a_config_error(value: float) -> None:
    with pytest.raises(ConfigError, match=r"peer_timeout_s="):
        policy.peer_timeout({}, value)


def test_collective_timeout_from_the_keyword_the_variable_or_torch() -> None:
    assert process_group.collective_timeout({}, None) is None  # torch's default
    assert process_group.collective_timeout({"DDPKIT_COLLECTIVE_TIMEOUT": "900"}, None) == 900.0
    assert process_group.collective_timeout({"DDPKIT_COLLECTIVE_TIMEOUT": "900"}, 5) == 5.0


@pytest.mark.parametrize("raw", ["10min", "-3", "0", "inf"])
def test_bad_collective_timeout_variable_is_a_config_error(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"DDPKIT_COLLECTIVE_TIMEOUT=") as info:
        process_group.collective_timeout({"DDPKIT_COLLECTIVE_TIMEOUT": raw}, None)
    assert raw.lstrip("-") in str(info.value) and info.value.hint


@pytest.mark.parametrize(
    ("name", "raw"), [("DDPKIT_PEER_TIMEOUT", "soon"), ("DDPKIT_COLLECTIVE_TIMEOUT", "x")]
)
def test_init_rejects_a_bad_variable_before_joining(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name}='{raw}'"):
        ddpkit.init(env={name: raw})
    assert runtime.current_or_none() is None


def test_interval_is_a_quarter_of_the_bound_at_most_one_second() -> None:
    assert policy.interval_for(60) == 1.0
    assert policy.interval_for(2) == 0.5


@pytest.mark.parametrize(
    ("bound_s", "world", "expected"),
    [
        (60, 1, 1.0),
        (60, 64, 1.0),
        (60, 512, 1.0),
        (60, 1024, 2.0),
        (60, 4096, 8.0),
        (60, 96000, 15.0),  # a quarter of the bound at most: 4 beats a bound
        (2, 4096, 0.5),
        (120, 4096, 8.0),
    ],
)
def test_the_beat_interval_stretches_with_the_world(
    bound_s: float, world: int, expected: float
) -> None:
    assert policy.beat_interval_for(bound_s, world) == expected


def test_the_heartbeat_load_at_the_store_stops_growing_past_512_ranks() -> None:
    # each rank other than 0 makes 2 store calls a beat (its beat and its poll); before, the
    # load was 2 calls/s per rank: 8,192 calls/s at 4,096 ranks
    load = {n: 2 * (n - 1) / policy.beat_interval_for(60, n) for n in (2**k for k in range(13))}
    assert load[4096] <= 2 * 512 and load[2048] <= 2 * 512 and load[1024] <= 2 * 512
    assert max(load.values()) <= 2 * 512
    assert load[4] == 6  # small worlds keep the 1 s beat


# --- naming ---------------------------------------------------------------------------------------


def _gone(rank: int | None, how: str, *, victim: bool = False) -> Departure:
    return Departure(rank, policy.describe_rank(rank or 0, "nodeB", 4242), how, victim=victim)


def test_the_first_rank_that_left_on_its_own_is_named() -> None:
    first_victim = _gone(0, "raised RuntimeError: Connection closed by peer", victim=True)
    culprit = _gone(2, "exited")
    assert policy.pick_cause([first_victim, culprit, _gone(3, "exited")], me=1) is culprit
    assert policy.pick_cause([first_victim], me=1) is first_victim  # better than nothing
    assert policy.pick_cause([_gone(1, "exited")], me=1) is None  # never itself


def test_messages_name_the_rank_host_pid_and_bound() -> None:
    cause = _gone(1, "exited")
    line = policy.abort_message(cause, me=0, waited_s=5.04, bound_s=5)
    assert line.startswith(
        "ddpkit: rank 1 on host nodeB (pid 4242) exited while rank 0 was waiting for it in a "
        "collective; ending rank 0 after 5.0 s (bound: DDPKIT_PEER_TIMEOUT=5)"
    )
    assert "ddpkit.shutdown()" in line and "\n" not in line
    raised = policy.raised_message(cause, me=2, error="RuntimeError", waited_s=2.0)
    assert raised.startswith("ddpkit: rank 1 on host nodeB (pid 4242) exited while rank 2")
    assert "the RuntimeError above" in raised
    assert "no rank reported leaving" in policy.raised_message(None, 2, "RuntimeError", 2.0)


def test_peer_failures_are_told_from_the_programs_own_errors() -> None:
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [1.2.3.4]:5")
    assert policy.looks_like_peer_failure(gloo)
    assert not policy.looks_like_peer_failure(ValueError("bad batch 17"))
    assert not policy.looks_like_peer_failure(RuntimeError("CUDA out of memory"))


# --- the blocked-thread check ---------------------------------------------------------------------


def _blocked_for(target_wait: threading.Event, work: threading.Thread) -> float:
    """Sample ``work`` like the watchdog does for ~1 s; how long it looked blocked."""
    work.start()
    time.sleep(0.2)
    progress = watcher.Progress(work, time.monotonic)
    start = time.monotonic()
    for _ in range(6):
        time.sleep(0.2)
        progress.sample(time.monotonic())
    target_wait.set()
    work.join()
    return time.monotonic() - max(progress.blocked_since, start)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="context switches need Linux")
def test_a_loop_of_short_sleeps_is_progress_a_blocking_wait_is_not() -> None:
    released = threading.Event()
    blocked = _blocked_for(released, threading.Thread(target=released.wait))
    assert blocked > 0.7  # one wait, same frame and instruction, no context switch

    done = threading.Event()

    def naps() -> None:  # the same frame and instruction at every sample, yet moving
        while not done.is_set():
            time.sleep(0.01)

    assert _blocked_for(done, threading.Thread(target=naps)) < 0.5


# --- real processes -------------------------------------------------------------------------------


def _threads() -> set[str]:
    deadline = time.monotonic() + 3.0
    while True:
        names = {t.name for t in threading.enumerate() if t.name.startswith("ddpkit-watchdog")}
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.05)


def _lifecycle_worker(rank: int, world_size: int, port: int, more: list[int]) -> dict[str, object]:
    seen: dict[str, object] = {}
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    seen["owned"] = watchdog.active() is not None
    seen["threads"] = sorted(
        t.name for t in threading.enumerate() if t.name.startswith("ddpkit-watchdog")
    )
    ddpkit.shutdown()
    seen["after_shutdown"] = (watchdog.active(), _threads())
    ddpkit.init(env=torchrun_env(rank, world_size, more[0], DDPKIT_PEER_TIMEOUT="off"))
    seen["off"] = watchdog.active()
    ddpkit.shutdown()
    url = f"tcp://127.0.0.1:{more[1]}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
    ddpkit.init(env=torchrun_env(rank, world_size, more[1]))
    seen["adopted"] = watchdog.active()
    ddpkit.shutdown()
    dist.destroy_process_group()
    return seen


@pytest.mark.multiproc
def test_started_for_an_owned_group_stopped_by_shutdown_absent_when_off_or_adopted() -> None:
    for seen in run_workers(_lifecycle_worker, 2, [free_port(), free_port()]):
        assert seen["owned"] is True
        assert seen["threads"] == [policy.THREAD_NAME]  # one thread
        assert seen["after_shutdown"] == (None, set())
        assert seen["off"] is None and seen["adopted"] is None


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def _named(rank: Rank, culprit: Rank, how: str) -> None:
    """``rank``'s stderr ends with the line naming ``culprit`` (rank, host, pid)."""
    subject = f"ddpkit: rank {culprit.rank} on host {HOST} (pid {culprit.pid()}) {how}"
    lines = [line for line in rank.err.splitlines() if line.startswith("ddpkit: ")]
    assert lines and lines[-1].startswith(subject), rank.err[-3000:]
    assert f"while rank {rank.rank} was waiting for it in a collective" in lines[-1]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("leave", "how"),
    [("return", "exited"), ("raise", "raised ValueError: boom from rank 1")],
)
def test_peer_failing_at_a_rank_that_returned_early_names_it(
    worker: Path, tmp_path: Path, leave: str, how: str
) -> None:
    # under SLURM's node names: a rank that raised (or returned) is no node's fault
    logs = tmp_path / "logs"
    rank0, rank1 = forked(worker, 2, ["--leave", leave, "--slurm-node-names"], bound_s=3,
                          env={"DDPKIT_LOG_DIR": str(logs)})  # fmt: skip
    assert list(logs.glob(".ddpkit-blamed-*")) == []
    assert rank1.code == (0 if leave == "return" else 1), rank1.err
    assert "ddpkit: " not in rank1.err  # the rank that left says nothing about itself
    assert rank0.code == 1, rank0.err[-3000:]  # on its own: the guard of forked kills with -9
    # gloo's own error, then the name: a peer that exits closes its socket (FIN), or resets it
    # when data it never read was waiting (RST; 1 run in 6 under load): gloo says which
    gloo = re.search(r"RuntimeError: .*Connection (closed|reset) by peer", rank0.err)
    assert gloo, rank0.err[-3000:]
    _named(rank0, rank1, how)


@pytest.mark.multiproc
def test_ddpkit_run_with_a_rank_returning_early_reports_it(worker: Path) -> None:
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", str(worker)]
    started = time.monotonic()
    done = subprocess.run(
        command,
        env=_child_env(DDPKIT_PEER_TIMEOUT="3"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    ended, elapsed = time.time(), time.monotonic() - started
    pids = {
        int(r): int(p) for r, p in re.findall(r"^\[rank\d\]: pid (\d) (\d+)$", done.stdout, re.M)
    }
    assert sorted(pids) == [0, 1], done.stdout
    # Not timed: the job ending by itself, with the survivor's exit code, within the guard of
    # 120 s shows that nothing waited for the 30-minute collective timeout.
    (left,) = re.findall(r"^\[rank1\]: leaving ([0-9.]+)$", done.stdout, re.M)
    after_leaving = ended - float(left)
    assert done.returncode == 1, (
        f"exit {done.returncode}, {after_leaving:.1f} s after rank 1 left, {elapsed:.1f} s in "
        f"all\n{done.stdout}\n{done.stderr}"
    )
    # The root cause is the survivor (not rank 1, which exited 0); its traceback, as the
    # launcher quotes it, ends with the name.
    report = done.stderr[done.stderr.index("ddpkit: worker failed (root cause): rank ") :]
    survivor = int(report.split("rank ", 1)[1].split(" ", 1)[0])
    assert survivor == 0
    named = (
        f"  ddpkit: rank 1 on host {HOST} (pid {pids[1]}) exited while rank {survivor} was "
        "waiting for it in a collective"
    )
    assert any(line.startswith(named) for line in report.splitlines()), report
    assert [pid for pid in pids.values() if _running(pid)] == []  # the launcher left nothing


@pytest.mark.multiproc
def test_a_killed_rank_is_named_by_both_survivors_and_its_node_blamed(worker: Path) -> None:
    """3 ranks under SLURM's node names (n<rank>, job 42) whose rank 1 is killed (one run,
    both checks). Heartbeats that stop are a node-local cause (the OOM killer, a dead or
    frozen node): the survivors name it and write the node to the job's blame file. (A rank
    that raised is no one's node fault:
    :func:`test_peer_failing_at_a_rank_that_returned_early_names_it`.)"""
    logs = worker.parent / "logs"
    logs.mkdir()
    ranks = forked(worker, 3, ["--leave", "kill", "--slurm-node-names"], bound_s=3,
                   env={"DDPKIT_LOG_DIR": str(logs)})  # fmt: skip
    assert ranks[1].code == -9
    for survivor in (ranks[0], ranks[2]):
        assert survivor.code == 1, survivor.err[-2000:]  # on its own, not the guard's kill
        _named(survivor, ranks[1], "stopped sending heartbeats")
    lines = (logs / ".ddpkit-blamed-42").read_text().splitlines()
    assert lines and all(line.startswith("n1\trank 1 stopped sending heartbeats") for line in lines)
    assert take_blamed(logs, "42") == {"n1": lines[0].split("\t", 1)[1]}


@pytest.mark.multiproc
def test_blocked_survivor_of_a_frozen_rank_is_ended_and_its_children_reaped(
    worker: Path,
) -> None:
    # SIGSTOP: rank 1 is alive but silent, so gloo raises nothing and rank 0 stays blocked in
    # all_reduce, as NCCL ranks stay blocked on a dead peer.
    rank0, rank1 = forked(
        worker, 2, ["--leave", "freeze", "--children"], bound_s=3, expect_stuck=(1,)
    )
    children = rank0.children()  # 2 data loader workers, 1 sleeper, with their start times
    running_after = [pid for pid, ticks in children if _running(pid) and start_ticks(pid) == ticks]
    for pid, ticks in children:  # a failure here must not leave them behind either
        signal_if_same(pid, ticks)
    assert len(children) == 3, rank0.out
    assert rank0.code == watchdog.ABORT_EXIT_CODE, rank0.err
    _named(rank0, rank1, "stopped sending heartbeats")
    assert "ending rank 0 after" in rank0.err and "DDPKIT_PEER_TIMEOUT=3" in rank0.err
    assert "in all_reduce" in rank0.err  # where it was blocked
    assert running_after == []


@pytest.mark.multiproc
@pytest.mark.parametrize("leaver", [1, 0])  # 0: the store's host leaves first
def test_rank_working_alone_after_its_peer_finished_is_left_alone(
    worker: Path, leaver: int
) -> None:
    # first work alone (short sleeps and computations: progress), then one long call of its
    # own (a single sleep: no context switch for seconds), blocked past the bound as a rank in a
    # collective is: it is not waiting for the peer that left, and a correct program is never
    # ended on that guess (before: ended after the bound, exit 1)
    args = ["--leave-rank", str(leaver), "--solo-s", "3", "--solo-call-s", "7"]
    ranks = forked(worker, 2, args, bound_s=2.5)
    solo = ranks[1 - leaver]
    assert [r.code for r in ranks] == [0, 0], solo.err[-3000:]
    assert "solo done" in solo.out and "solo call done" in solo.out
    assert "ddpkit:" not in solo.err and "TCPStore" not in solo.err  # nothing, not even noise


# --- rank 0's judging, and the markers (pure) -------------------------------------------------


def test_rank_zero_names_the_ranks_still_for_the_bound_each_once() -> None:
    judge = BeatJudge(0, bound_s=10.0)
    assert judge.still([b"0"] * 6, 0.0) == []  # the first round: every counter counts from now
    assert judge.still([b"0", b"1", b"1", b"0", b"1", b"0"], 3.0) == []  # 3 and 5 stood still
    assert judge.still([b"0", b"2", b"2", b"0", b"2", b"1"], 4.0) == []  # 5 moved again
    still = judge.still([b"0", b"3", b"3", b"0", b"3", b"2"], 10.0)
    assert still == [(3, 10.0)]  # rank 0 itself is never judged
    # judged gone: a counter that moves again does not bring it back, nor name it twice
    assert judge.still([b"0", b"4", b"4", b"1", b"4", b"3"], 20.0) == []


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"[1, 2]", b'"text"', b'{"age_s": "soon"}', b"\xff\xfe", b"null"],
)
def test_a_marker_or_introduction_anyone_could_have_written_is_read_without_raising(
    raw: bytes,
) -> None:
    """The store is not ddpkit's alone: whoever reaches its port can write any key."""
    departure = read_marker(3, raw, 100.0)
    assert (departure.rank, departure.victim) == (3, False) and departure.who.startswith("rank 3")
    assert read_who(raw) == (None, None, None)


def test_a_marker_tells_who_left_how_and_when() -> None:
    raw = b'{"host": "n1", "pid": 42, "how": "exited", "age_s": 2.5, "victim": true, "node": "c1"}'
    departure = read_marker(5, raw, 100.0)
    assert departure == Departure(5, "rank 5 on host n1 (pid 42)", "exited", True, 97.5, "c1")
    assert read_who(b'{"host": "n1", "pid": 42, "node": null}') == ("n1", 42, None)
