"""The hang watchdog: every rank alive, one stuck; the job ends within the bound with one report
naming the stuck rank, and the rank-0-only ``if`` rank 0's collective runs under, if any. A
collective in rank-0-only code alone is left alone (main-process-first is correct code).

Pure pieces (bounds, the diagnosis, the report, the reading of rank-0-only ``if`` tests) run
in-process, and so does the reader of torch's flight recorder, on a real gloo group. The
scenarios start real ranks (gloo on 127.0.0.1): 2, or 3 where the ranks waiting in one
collective are a majority against the odd one, with a small per-collective bound (3 s) and a
large first bound (60 s): the report naming ``DDPKIT_HANG_TIMEOUT=3`` shows that the tight
bound applied after the first step, and every rank ending on its own, with the watchdog's exit
code, before the test's guard kills it shows that nothing waited for torch's 30-minute
collective timeout. No test times the ending: on this loaded 2-core machine the start of three
ranks alone took up to 20 s.

Each scenario's ranks are processes forked from the fork server of
:mod:`tests.support.distutil` (torch imported once), each running the worker script as
``__main__`` with its own environment, stdout, stderr and exit code, and ending as an
interpreter does (its threads, then its atexit handlers): a fresh interpreter per rank
imported torch anew, most of these tests' CPU. ``ddpkit run`` with fresh interpreters keeps
its own scenario (the last test).
"""

from __future__ import annotations

import ast
import dataclasses
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.worker import watchdog
from ddpkit.worker.watchdog import flight, hang
from ddpkit.worker.watchdog.hang import is_rank_zero_test, rank_zero_if
from tests.support.distutil import FORKSERVER_PRELOAD, free_port
from tests.support.pids import start_ticks
from tests.support.spawned import Rank, child_env, forked, running

pytestmark = pytest.mark.sidecar  # mostly waiting: run beside the SLURM tests (ci/test.sh)

HOST = socket.gethostname()
# DDPKIT_HANG_ACTION=end: the scenarios below end at the report (the default only reports)
BOUNDS = {
    "DDPKIT_HANG_TIMEOUT": "3",
    "DDPKIT_HANG_FIRST_TIMEOUT": "60",
    "DDPKIT_HANG_ACTION": "end",
}

WORKER = """
import argparse, os, time
import torch
import torch.distributed as dist
import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument(
    "--case",
    choices=[
        "sleep", "other", "loader", "rank0", "busy", "ddp", "gil", "eval"
    ],
)
parser.add_argument("--dir", default="")
parser.add_argument("--stuck", type=int, default=1)
opts = parser.parse_args()
if opts.case == "eval":  # each rank keeps the report in a log folder of its own
    os.environ["DDPKIT_LOG_DIR"] = os.path.join(opts.dir, "rank" + os.environ["RANK"])

ctx = ddpkit.init()
print(f"pid {ctx.rank} {os.getpid()}", flush=True)


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, index):
        if index >= 4:
            time.sleep(600)  # a slow filesystem
        return torch.ones(2)


value = torch.ones(4)
if opts.case == "busy" and ctx.is_main:
    time.sleep(7)  # rank 0 prepares data before the first step: more than the tight bound
for step in range(3):
    dist.all_reduce(value)
if opts.case == "ddp":  # DDP all-reduces from C++ inside backward(): no Python collective
    model = ddpkit.wrap(torch.nn.Linear(8, 2))
    for step in range(100):
        loss = model(torch.randn(4, 8)).sum()
        if step == 5 and ctx.rank == opts.stuck:
            time.sleep(600)  # stuck before backward
        loss.backward()
if opts.case == "busy":  # then rank 0 writes slowly (a slow filesystem); the others wait
    from ddpkit.worker import asyncsave, checkpoint
    def slow(call):
        return lambda *args, **kwargs: (time.sleep(4.5), call(*args, **kwargs))[1]
    checkpoint.save_payload = slow(checkpoint.save_payload)
    ddpkit.save_checkpoint(opts.dir, {"value": value}, step=3)
    dist.all_reduce(value)
    print("saved", flush=True)
    # then in the background: the others wait while rank 0 copies the state (a big model),
    # then at wait_for_checkpoint for rank 0's slow write
    asyncsave.snapshot = slow(asyncsave.snapshot)
    asyncsave.save_payload = slow(asyncsave.save_payload)
    ddpkit.async_save_checkpoint(opts.dir, {"value": value}, step=4)
    dist.all_reduce(value)
    ddpkit.wait_for_checkpoint()
    dist.all_reduce(value)
    print("saved in the background", flush=True)
if opts.case == "eval":  # rank 0 evaluates alone inside the loop, longer than the bound:
    # until its watchdog has the report (kept in its log folder, then printed), 60 s at most
    # (a fixed 7 s ended before the report came on a loaded machine: rank 0 never printed it)
    report = os.path.join(os.environ["DDPKIT_LOG_DIR"], "ddpkit-hang-report.txt")
    evaluating = time.monotonic() + 60
    while ctx.is_main and not os.path.exists(report) and time.monotonic() < evaluating:
        time.sleep(0.1)  # evaluating
    dist.all_reduce(value)
    print(f"sum {value.tolist()}", flush=True)
if opts.case in ("busy", "eval"):
    raise SystemExit(0)
if opts.case == "loader" and ctx.rank == opts.stuck:
    batches = iter(torch.utils.data.DataLoader(Slow(), batch_size=2, num_workers=1))
    pids = [w.pid for w in batches._workers]  # with start times: see tests.support.pids
    ticks = [open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19] for pid in pids]
    print("children " + " ".join(f"{pid}:{t}" for pid, t in zip(pids, ticks)), flush=True)
    for batch in batches:
        dist.all_reduce(value)
if opts.case == "gil" and ctx.rank == opts.stuck:
    import re
    re.match(r"(a+)+$", "a" * 40 + "b")  # holds the GIL for hours: no thread of it runs
if opts.case == "sleep" and ctx.rank == opts.stuck:
    time.sleep(600)
if opts.case == "other" and ctx.rank == opts.stuck:
    dist.barrier()  # other
if opts.case == "rank0" and ctx.is_main:
    dist.barrier()  # rank0
while True:
    dist.all_reduce(value)
"""


def _line(code: str) -> int:
    """The line of the worker script holding ``code``."""
    return next(i for i, text in enumerate(WORKER.splitlines(), 1) if text.strip() == code)


def _site(worker: Path, code: str) -> str:
    """``<folder>/worker.py:<line>``, as the report writes a place."""
    return f"{worker.parent.name}/worker.py:{_line(code)}"


# --- bounds --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "explicit", "expected"),
    [
        ({}, (None, None), (900.0, 180.0)),
        ({"DDPKIT_HANG_TIMEOUT": "5"}, (None, None), (900.0, 5.0)),
        ({"DDPKIT_HANG_TIMEOUT": "5", "DDPKIT_HANG_FIRST_TIMEOUT": "30"}, (None, None), (30, 5)),
        ({"DDPKIT_HANG_TIMEOUT": "50", "DDPKIT_HANG_FIRST_TIMEOUT": "20"}, (None, None), (50, 50)),
        ({"DDPKIT_HANG_TIMEOUT": "5"}, (7, 8), (8.0, 7.0)),  # the keywords win
        ({"DDPKIT_HANG_TIMEOUT": "off"}, (None, None), None),
        ({"DDPKIT_HANG_TIMEOUT": "0"}, (None, None), None),
        ({}, (0, None), None),
    ],
)
def test_bounds_from_keywords_variables_or_defaults(
    env: dict[str, str], explicit: tuple[float | None, float | None], expected: object
) -> None:
    bounds = hang.hang_bounds(env, *explicit, world_size=8)
    got = None if bounds is None else (bounds.first_s, bounds.step_s)
    assert got == expected


def test_the_bound_grows_with_the_world_size_past_64_ranks() -> None:
    assert [hang.scaled_for(100, n) for n in (2, 64, 512, 4096)] == [100, 100, 150, 200]
    bounds = hang.hang_bounds({"DDPKIT_HANG_TIMEOUT": "100"}, None, None, world_size=4096)
    assert bounds is not None and bounds.bound(past_first_step=True) == 200
    assert bounds.bound(past_first_step=False) == 900
    assert bounds.which(True) == "DDPKIT_HANG_TIMEOUT=100 x 2.00 for the world size"
    assert bounds.which(False) == "DDPKIT_HANG_FIRST_TIMEOUT=900, before the first step"


@pytest.mark.parametrize(
    ("name", "raw"),
    [("DDPKIT_HANG_TIMEOUT", "soon"), ("DDPKIT_HANG_FIRST_TIMEOUT", "-3")],
)
def test_a_bad_bound_is_a_config_error_naming_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=name):
        hang.hang_bounds({name: raw}, None, None, world_size=2)


def test_a_bad_keyword_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="hang_timeout_s"):
        hang.hang_bounds({}, -1, None, world_size=2)


# --- the diagnosis and the report ----------------------------------------------------------------


def _call(op: str, seq: int, site: str = "train.py:40", age_s: float = 4.0) -> dict[str, object]:
    return {"op": op, "seq": seq, "group": "default_pg", "sizes": "[4] float32", "site": site,
            "age_s": age_s, "running": True}  # fmt: skip


def _piece(rank: int, running: dict[str, object] | None, at: str = "train.py:40") -> dict:
    frame = ["train.py", int(at.split(":")[1]), "<module>", "step()"]
    return {
        "host": f"n{rank // 2}",
        "pid": 100 + rank,
        "stack": [["/job/train.py", frame[1], "<module>", "step()"]],
        "at": frame,
        "running": running,
        "last": _call("all_reduce", 7),
        "tail": [],
        "loader": None,
    }


def test_the_rank_outside_the_collective_is_the_odd_one() -> None:
    pieces = {r: _piece(r, _call("all_reduce", 8)) for r in (0, 1, 2)}
    pieces[3] = _piece(3, None, at="train.py:88")
    assert hang.diagnose(pieces, 4) == ([3], [0, 1, 2], [])
    line = hang.headline(pieces, 4, 5.0, "DDPKIT_HANG_TIMEOUT=3")
    assert line.startswith(
        "ddpkit: hang: rank 3 (host n1, pid 103) is in train.py:88 `step()`, not in a "
        "collective; its last collective: all_reduce #7"
    )
    assert "; ranks 0-2 wait in all_reduce #8 [4] float32 on default_pg at train.py:40" in line


def test_a_rank_in_another_collective_and_a_silent_rank_are_named() -> None:
    pieces = {r: _piece(r, _call("all_reduce", 8)) for r in (0, 2, 3)}
    pieces[1] = _piece(1, _call("barrier", 8, site="train.py:50"))
    assert hang.diagnose(pieces, 5) == ([1], [0, 2, 3], [4])
    line = hang.headline(pieces, 5, 5.0, "b")
    assert (
        "rank 1 (host n0, pid 101) is in barrier #8 [4] float32 on default_pg at train.py:50"
        in line
    )
    assert "rank 4 did not answer" in line and "ranks 0,2-3 wait in all_reduce #8" in line


_UNDER = {"file": "/job/train.py", "line": 41, "code": "barrier()", "if_line": 40,
          "test": "ctx.is_main"}  # fmt: skip


def test_a_rank_zero_only_if_is_named_only_when_rank_zero_waits_apart() -> None:
    # 2 ranks, a tie: rank 0 in a barrier under `if ctx.is_main:`, rank 1 in an all_reduce
    pieces = {0: _piece(0, _call("barrier", 8, site="train.py:41")), 1: _piece(1, None)}
    pieces[1]["running"] = _call("all_reduce", 8, site="train.py:50")
    pieces[0]["under"] = _UNDER
    assert hang.diagnose(pieces, 2) == ([0], [1], [])
    line = hang.headline(pieces, 2, 5.0, "b")
    assert line.startswith(
        "ddpkit: hang: rank 0 (host n0, pid 100) is in barrier #8 [4] float32 on default_pg at "
        "train.py:41 (for 4.0 s), called under `if ctx.is_main:` (job/train.py:40), rank-0-only "
        "code that rank 1 skips; rank 1 waits in all_reduce #8"
    ), line
    # every rank in the same barrier (main-process-first's shape): nobody is blamed for the if
    pieces[1]["running"] = _call("barrier", 8, site="train.py:41")
    assert hang.diagnose(pieces, 2) == ([], [0, 1], [])
    assert "rank-0-only" not in hang.report(pieces, 2, 5.0, "b", reporter=0)


def test_no_rank_in_a_collective_names_nobody() -> None:
    pieces = {r: _piece(r, None) for r in (0, 1)}
    assert hang.diagnose(pieces, 2) == ([], [], [])


def test_identical_stacks_are_grouped_the_largest_group_last() -> None:
    pieces = {r: _piece(r, _call("all_reduce", 8)) for r in range(4)}
    pieces[2] = _piece(2, None, at="train.py:88")
    pieces[2]["tail"] = [_call("all_reduce", 6) | {"site": None}]
    del pieces[3]
    text = hang.report(pieces, 4, 5.0, "b", reporter=0, silent={3: "; sent SIGURG"})
    assert "; before: all_reduce #6 [4] float32 on default_pg\n" in text
    assert "\n  rank 3: no answer; sent SIGURG\n" in text
    stacks = [line for line in text.splitlines() if line.startswith("ddpkit: stack of")]
    assert stacks == [
        "ddpkit: stack of rank 2 (main thread, innermost last):",
        "ddpkit: stack of ranks 0-1 (main thread, innermost last):",
    ]
    assert '  File "/job/train.py", line 88, in <module>' in text


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([3], "rank 3"), ([2, 0, 1], "ranks 0-2"), ([0, 2, 5, 6, 7], "ranks 0,2,5-7")],
)
def test_ranks_text(ranks: list[int], text: str) -> None:
    assert hang.ranks_text(ranks) == text


# --- the flight recorder ------------------------------------------------------------------------


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo group of one, as ``init()`` makes it: torch's recorder keeps its collectives."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    store.set_timeout(timedelta(seconds=20))
    with flight.recording():
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_the_recorder_gives_the_calls_and_the_phase_but_not_the_callers_place() -> None:
    dist.barrier()  # before the watchdog starts (init's own collectives): never a step
    reader = flight.Flight()
    dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(2, 3, dtype=torch.int64), src=0)
    assert not reader.note_phase()  # nothing completed twice alike since it started
    dist.all_reduce(torch.ones(4))  # the loop came round
    # torch's recorder can mark a call done a moment after it returned (CI run 9: not yet at
    # the first read); the watchdog reads it each interval: so does this, 10 s at most
    deadline = time.monotonic() + 10
    while not reader.note_phase() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader.note_phase()
    running, done = reader.calls()
    while running is not None and time.monotonic() < deadline:
        time.sleep(0.01)
        running, done = reader.calls()
    assert running is None
    assert [(c["op"], c["sizes"], c["group"], c["running"]) for c in done] == [
        ("all_reduce", "[4] float32", "default_pg", False),
        ("broadcast", "[2, 3] int64", "default_pg", False),
        ("all_reduce", "[4] float32", "default_pg", False),
    ]
    assert done[2]["seq"] == done[0]["seq"] + 2  # torch's sequence number of the group
    # the gap the report fills from the main thread's stack: the recorder keeps no call site
    entries = flight.compat.flight_recorder(True)
    assert entries is not None
    assert all("frames" not in e and "site" not in e for e in entries["entries"]), entries


def test_a_call_behind_a_lagging_status_is_still_seen_waiting() -> None:
    """The group's status can lag behind calls that returned: it says 2 completed while #3
    returned (its entry retired) and #4 waits. #3 is set aside, #4 is the one waiting (only
    the first number the status held open was taken: #3, retired, hid #4, and a lone waiting
    rank never reported)."""
    created = 1_000_000_000_000_000_000
    entries = [
        {"pg_id": 0, "collective_seq_id": seq, "retired": seq < 4, "time_created_ns": created,
         "profiling_name": "gloo:all_reduce", "input_sizes": [[4]], "input_dtypes": ["Float"]}
        for seq in (1, 2, 3, 4)
    ]  # fmt: skip
    status = {
        "pg_status": {"0": {"last_enqueued_collective": "0", "last_completed_collective": "0"}}
    }
    dumps = {"status": status}

    def dump(with_entries: bool) -> dict[str, object]:
        return {**dumps["status"], **({"entries": entries} if with_entries else {})}

    reader = flight.Flight(dump=dump, wall_ns=lambda: created)
    dumps["status"] = {
        "pg_status": {"0": {"last_enqueued_collective": "4", "last_completed_collective": "2"}}
    }
    assert reader.in_collective()
    assert reader.waiting(10.0) == (0.0, False)
    reader.look(13.0)  # the oldest open number first: #3, retired by its entry
    reader.look(13.0)  # then #4 (made at the wall clock's now): open since it was first seen
    assert reader.waiting(20.0) == (10.0, False)
    assert reader.past_first_step  # #1 and #2 completed alike
    running, _ = reader.calls()
    assert running is not None and running["seq"] == 4


class _Recorder:
    """A recorder whose status and entries a test sets, as gloo's can be read mid-call."""

    def __init__(self) -> None:
        self.created = 1_000_000_000_000_000_000
        self.made, self.done, self.retired = 0, 0, set[int]()

    def dump(self, with_entries: bool) -> dict[str, object]:
        status = {"last_enqueued_collective": str(self.made),
                  "last_completed_collective": str(self.done)}  # fmt: skip
        entries = [
            {"pg_id": 0, "collective_seq_id": seq, "retired": seq in self.retired,
             "time_created_ns": self.created, "profiling_name": "gloo:broadcast",
             "input_sizes": [[1]], "input_dtypes": ["Long"]}
            for seq in range(1, self.made + 1)
        ]  # fmt: skip
        return {"pg_status": {"0": status}, **({"entries": entries} if with_entries else {})}


def test_a_wait_that_ended_inside_patient_keeps_the_first_bound_while_the_status_lags() -> None:
    """gloo records a completion after the call returned (measured: a third of all_reduces,
    and broadcasts' status until a later collective completes): a wait for rank 0's checkpoint
    write, seen inside patient(), still looks open once patient() ended; it keeps the first
    bound (stop 53's run 5 ended a healthy job in the "busy" scenario)."""
    recorder = _Recorder()
    reader = flight.Flight(dump=recorder.dump, wall_ns=lambda: recorder.created)
    recorder.made, recorder.done = 2, 2  # two calls alike: past the first step
    assert reader.note_phase()
    recorder.made = 3
    with flight.patient():
        assert reader.waiting(0.0) == (0.0, True)
        reader.look(4.0)  # looked at while open, 7 s of waiting for rank 0
        assert reader.waiting(7.0) == (7.0, True)
    assert reader.waiting(7.1) == (7.1, True)  # returned; its completion not recorded yet
    recorder.made, recorder.retired = 4, {3}  # the next call, outside patient()
    assert reader.waiting(7.2) == (7.2, True)  # #3 still held open by the status
    reader.look(7.3, again=True)  # #3 retired by its entry: set aside
    assert reader.waiting(10.0) == (2.8, False)  # #4 waits on its own, tight bound


def test_a_collective_retired_since_it_was_looked_at_is_not_reported() -> None:
    """A call looked at while open (its age, once) is read again before a report: retired by
    now, with the group's status still behind, it is not a hang."""
    recorder = _Recorder()
    reader = flight.Flight(dump=recorder.dump, wall_ns=lambda: recorder.created)
    recorder.made, recorder.done = 3, 2
    assert reader.waiting(0.0) == (0.0, False)
    reader.look(4.0)
    recorder.retired = {3}
    reader.look(9.0)  # once per collective: not read again
    assert reader.waiting(9.0) == (9.0, False)
    reader.look(9.0, again=True)
    assert reader.waiting(9.0) is None


def _rank1_peer(port: int) -> None:
    """Rank 1 of the group below, forked from the fork server: it joins, waits for "go",
    then meets rank 0's all_reduce."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=60)
    )
    store.wait(["go"], timedelta(seconds=60))
    dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()


def test_a_collective_in_flight_is_seen_from_another_thread_then_seen_done() -> None:
    port = free_port()
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    peer = context.Process(target=_rank1_peer, args=(port,), daemon=True)
    peer.start()
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True)
        store.set_timeout(timedelta(seconds=60))
        with flight.recording():
            dist.init_process_group("gloo", store=store, rank=0, world_size=2)
        try:
            _in_flight_then_done(store)
        finally:
            dist.destroy_process_group()
        peer.join(60)
        assert peer.exitcode == 0
    finally:
        if peer.exitcode is None:
            peer.kill()
        peer.join()


def _in_flight_then_done(store: dist.TCPStore) -> None:
    reader = flight.Flight()
    assert not reader.in_collective() and reader.waiting(0) is None
    call = threading.Thread(target=lambda: dist.all_reduce(torch.ones(4)))
    with flight.patient():
        call.start()  # rank 1 waits for "go": this one stays in flight
        deadline = time.monotonic() + 30
        while reader.waiting(1) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reader.in_collective()
        assert reader.waiting(5) == (4, True)  # first seen at 1; inside patient()
    assert reader.waiting(6) == (5, True)  # seen inside patient(): it keeps the first bound
    running, _ = reader.calls()
    assert running is not None and (running["op"], running["running"]) == ("all_reduce", True)
    assert running["sizes"] == "[4] float32" and running["age_s"] >= 0
    store.set("go", "1")
    call.join(30)
    assert not call.is_alive()
    while reader.in_collective() and time.monotonic() < deadline:
        time.sleep(0.05)  # torch marks it completed just after the call returns
    assert not reader.in_collective() and reader.waiting(7) is None


@pytest.mark.parametrize(
    ("env", "after"),
    [
        ({}, None),
        ({"TORCH_FR_BUFFER_SIZE": "0"}, "0"),
        ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "9"}, None),
    ],
)
def test_the_recorder_is_enabled_only_while_the_group_is_made_and_never_over_the_user(
    env: dict[str, str], after: str | None
) -> None:
    inside = dict(env)
    with flight.recording(inside):
        seen = inside.get("TORCH_FR_BUFFER_SIZE")
    assert seen == (str(flight.BUFFER_SIZE) if not env else env.get("TORCH_FR_BUFFER_SIZE"))
    assert inside.get("TORCH_FR_BUFFER_SIZE") == after and inside == env


def test_stacks_come_on_sigurg_only_where_nothing_handled_it(
    capfd: pytest.CaptureFixture[str],
) -> None:
    from ddpkit.worker.watchdog import hangwatch

    previous = signal.signal(signal.SIGURG, lambda *_: None)  # the program's own handler
    try:
        assert not hangwatch.stacks_on_signal()
    finally:
        signal.signal(signal.SIGURG, previous)
    assert hangwatch.stacks_on_signal()
    try:
        os.kill(os.getpid(), signal.SIGURG)  # what the gathering rank sends a silent rank
        time.sleep(0.2)
    finally:
        hangwatch.stacks_off()
    err = capfd.readouterr().err
    assert re.search(r'File ".*test_hangs.py", line \d+ in test_stacks_come_on_sigurg', err), err
    os.kill(os.getpid(), signal.SIGURG)  # ignored again, as before: nothing written
    time.sleep(0.2)
    assert "test_hangs.py" not in capfd.readouterr().err


# --- rank-0-only code ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("test", "rank_zero"),
    [
        ("ctx.is_main", True),
        ("ctx.is_main and epoch % 5 == 0", True),
        ("fabric.is_global_zero", True),
        ("dist.get_rank() == 0", True),
        ("0 == rank", True),
        ("self.global_rank == 0", True),
        ("ctx.is_main or debug", False),
        ("not ctx.is_main", False),
        ("dist.get_rank(pp_group) == 0", False),  # a subgroup's rank 0
        ("ctx.local_rank == 0", False),
        ("rank == 1", False),
        ("rank == False", False),
    ],
)
def test_which_if_tests_hold_on_rank_zero_only(test: str, rank_zero: bool) -> None:
    assert is_rank_zero_test(ast.parse(test, mode="eval").body) is rank_zero


GUARDED = """
def save(collective):
    collective()


def main(ctx, collective):
    if ctx.is_main:
        save(collective)
    if ctx.is_main:
        print("no collective here")
    else:
        collective()
    collective()
"""


def test_a_stack_inside_a_rank_zero_only_if_names_it_and_others_do_not(tmp_path: Path) -> None:
    path = tmp_path / "train_guarded.py"
    path.write_text(GUARDED)
    namespace: dict[str, object] = {}
    exec(compile(GUARDED, str(path), "exec"), namespace)
    stacks: list[list[list[object]]] = []

    def barrier() -> None:  # what the hang report sees: the stack at the collective
        frame = sys._getframe(1)
        rows = []
        while frame is not None:
            rows.append([frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, ""])
            frame = frame.f_back  # type: ignore[assignment]
        stacks.append(rows[::-1])

    class Main:
        is_main = True

    class Other:
        is_main = False

    namespace["main"](Main(), barrier)  # type: ignore[operator]  # nothing raises: it runs
    namespace["main"](Other(), barrier)  # type: ignore[operator]
    found = [rank_zero_if(stack) for stack in stacks]
    assert found[0] == {
        "file": str(path), "line": 8, "code": "", "if_line": 7, "test": "ctx.is_main"
    }  # fmt: skip
    # the last call on rank 0, the else branch and the last call on the others: none
    assert found[1:] == [None, None, None]


# --- the scenarios -------------------------------------------------------------------------------


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def _run(
    worker: Path,
    case: str,
    *,
    stuck: int = 1,
    world_size: int = 3,
    extra: tuple[str, ...] = (),
    frozen: tuple[int, ...] = (),
    action: str = "end",
    guard_s: float = 120.0,
) -> list[Rank]:
    args = ["--case", case, "--stuck", str(stuck), *extra]
    env = {**BOUNDS, "DDPKIT_HANG_ACTION": action}
    # The peer bound is 30 s, far above the hang bound: a rank sleeping at a load of ~13 on 2
    # cores once sent no heartbeat for 3 s (the old bound), and its peer ended on that
    # instead of on the hang report these scenarios are about.
    ranks = forked(worker, world_size, args, bound_s=30, env=env, expect_stuck=frozen,
                   timeout_s=guard_s)  # fmt: skip
    left = [rank.pid() for rank in ranks if running(rank.pid())]
    children = [child for rank in ranks for child in rank.children()]
    left += [pid for pid, ticks in children if running(pid) and start_ticks(pid) == ticks]
    assert left == [], f"left running: {left}"
    return ranks


def _report_of(rank0: Rank) -> str:
    lines = rank0.err.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("ddpkit: hang: ")]
    assert len(heads) == 1, rank0.err[-4000:]
    return "\n".join(lines[heads[0] :])


def _ended_by_the_report(ranks: list[Rank], reported_by: int = 0) -> None:
    for rank in ranks:
        assert rank.code == watchdog.ABORT_EXIT_CODE, rank.err[-3000:]  # not spawn's kill
        if rank.rank != reported_by:
            assert f"ddpkit: rank {rank.rank} ends: the hang watchdog's report" in rank.err
        assert "Traceback" not in rank.err, rank.err[-3000:]  # no noise from ended collectives


@pytest.mark.multiproc
@pytest.mark.parametrize("stuck", [1, 0])  # 0: the store's host and reporter is the stuck one
def test_a_rank_sleeping_before_a_collective_is_named(worker: Path, stuck: int) -> None:
    ranks = _run(worker, "sleep", stuck=stuck)
    _ended_by_the_report(ranks)
    report = _report_of(ranks[0])
    waiters = "ranks 1-2" if stuck == 0 else "ranks 0,2"
    who = f"rank {stuck} (host {HOST}, pid {ranks[stuck].pid()})"
    place = f"{_site(worker, 'time.sleep(600)')} `time.sleep(600)`, not in a collective"
    assert report.startswith(f"ddpkit: hang: {who} is in {place}"), report
    assert f"; {waiters} wait in all_reduce #" in report.splitlines()[0]
    assert "bound: DDPKIT_HANG_TIMEOUT=3)" in report.splitlines()[0]
    assert f"ddpkit: stack of rank {stuck} (main thread, innermost last):" in report
    assert f"ddpkit: stack of {waiters} (main thread, innermost last):" in report
    assert "; before: all_reduce #" in report  # from torch's flight recorder


@pytest.mark.multiproc
def test_a_rank_in_a_different_collective_is_named(worker: Path) -> None:
    ranks = _run(worker, "other")
    _ended_by_the_report(ranks)
    head = _report_of(ranks[0]).splitlines()[0]
    found = re.search(
        rf"is in barrier #(\d+) on default_pg at {worker.parent.name}/worker.py:(\d+)", head
    )
    assert found and head.startswith(f"ddpkit: hang: rank 1 (host {HOST}, pid {ranks[1].pid()})")
    assert int(found.group(2)) == _line("dist.barrier()  # other")
    assert f"ranks 0,2 wait in all_reduce #{found.group(1)} [4] float32 on default_pg" in head


@pytest.mark.multiproc
def test_a_rank_stuck_in_its_data_loader_worker_is_named(worker: Path) -> None:
    ranks = _run(worker, "loader", world_size=2)
    _ended_by_the_report(ranks)
    ((child, _),) = ranks[1].children()
    head = _report_of(ranks[0]).splitlines()[0]
    assert head.startswith(
        f"ddpkit: hang: rank 1 (host {HOST}, pid {ranks[1].pid()}) is in "
        f"{_site(worker, 'for batch in batches:')} `for batch in batches:`, not in a collective, "
        f"waiting for its data loader worker(s) (pids {child})"
    ), head


@pytest.mark.multiproc
def test_a_rank_missing_from_ddps_gradient_all_reduce_is_named(worker: Path) -> None:
    # 3 ranks, as before 2026-12-02: at 2 the one waiting rank's watchdog alone must see its
    # all-reduce in flight, and in one CI run (and once at a load of 25) none did for 120 s:
    # no report, rank 0 killed by the guard. That is an open bug (see the notes).
    ranks = _run(worker, "ddp", stuck=2)
    _ended_by_the_report(ranks)
    head = _report_of(ranks[0]).splitlines()[0]
    place = f"{_site(worker, 'time.sleep(600)  # stuck before backward')}"
    assert head.startswith(
        f"ddpkit: hang: rank 2 (host {HOST}, pid {ranks[2].pid()}) is in {place} "
        "`time.sleep(600)  # stuck before backward`, not in a collective; its last "
        "collective: all_reduce #"
    ), head
    # DDP's bucket all-reduce, made from C++: torch's recorder has it; the place is the frame
    waited = re.search(
        r"ranks 0-1 wait in all_reduce #\d+ \[18\] float32 on default_pg at (\S+) ", head
    )
    assert waited and waited.group(1) == _site(worker, "loss.backward()"), head


@pytest.mark.multiproc
def test_rank_zero_holding_the_gil_is_reported_by_the_rank_that_gathered(worker: Path) -> None:
    # rank 0 answers nothing and judges no heartbeats; the store (C++) still serves the others.
    # A rank whose threads cannot run cannot end itself: its launcher ends it (here: the test).
    ranks = _run(worker, "gil", stuck=0, frozen=(0,))
    reporter = next(rank for rank in ranks[1:] if rank.err.startswith("ddpkit: hang: "))
    _ended_by_the_report(ranks[1:], reported_by=reporter.rank)
    lines = reporter.err.splitlines()
    head = next(line for line in lines if line.startswith("ddpkit: hang: "))
    assert head.startswith(
        "ddpkit: hang: rank 0 did not answer within the gathering time (frozen, or its threads "
        "cannot run: a long call holding the GIL?); ranks 1-2 wait in all_reduce #"
    ), head
    assert f"ddpkit: hang report (gathered by rank {reporter.rank}), each rank:" in lines
    # its threads' stacks, from faulthandler on the signal the gathering rank sent it
    assert (
        "  rank 0: no answer; sent SIGURG: faulthandler writes its threads' stacks to its "
        f"stderr (pid {ranks[0].pid()})"
    ) in lines
    regex = _line(
        're.match(r"(a+)+$", "a" * 40 + "b")  # holds the GIL for hours: no thread of it runs'
    )
    assert f'  File "{worker}", line {regex} in <module>' in ranks[0].err, ranks[0].err[-3000:]


@pytest.mark.multiproc
def test_a_barrier_in_rank_zero_only_code_is_named_in_the_hang_report(worker: Path) -> None:
    # nothing raises before the collective (main-process-first is correct code): the hang is
    # reported, and the report names the `if` rank 0's barrier runs under
    ranks = _run(worker, "rank0", world_size=2)  # a tie: rank-0-only code is the odd one
    _ended_by_the_report(ranks)
    head = _report_of(ranks[0]).splitlines()[0]
    line = _line("dist.barrier()  # rank0")
    assert head.startswith(
        f"ddpkit: hang: rank 0 (host {HOST}, pid {ranks[0].pid()}) is in barrier #"
    ), head
    assert (f" on default_pg at {_site(worker, 'dist.barrier()  # rank0')} (for ") in head, head
    assert (
        f"called under `if opts.case == 'rank0' and ctx.is_main:` ({worker.parent.name}/"
        f"worker.py:{line - 1}), rank-0-only code that rank 1 skips; rank 1 waits in "
        "all_reduce #"
    ) in head, head
    assert all("UsageError" not in rank.err for rank in ranks)


@pytest.mark.multiproc
def test_by_default_a_report_is_printed_and_the_job_goes_on(worker: Path) -> None:
    # rank 0 evaluates inside the loop while the others wait in an all_reduce, past the 3-s
    # bound (until the report is made): a guess from timing (slow, or stuck?) reports; it
    # never ends a correct job
    # Open bug (the 2-rank DDP case's shape, see above): now and then the lone waiting rank 1
    # makes no report within the 60 s, with fresh interpreters as with forked ranks
    ranks = _run(worker, "eval", world_size=2, action="report", extra=("--dir", str(worker.parent)))
    assert [rank.code for rank in ranks] == [0, 0], ranks[0].err[-3000:]
    for rank in ranks:  # 1, then x2 in each of 4 all_reduces
        assert rank.out.splitlines()[-1] == "sum [16.0, 16.0, 16.0, 16.0]", rank.out
    head = _report_of(ranks[0]).splitlines()[0]
    assert head.startswith(
        f"ddpkit: hang: rank 0 (host {HOST}, pid {ranks[0].pid()}) is in "
        f"{_site(worker, 'time.sleep(0.1)  # evaluating')} `time.sleep(0.1)  # evaluating`, "
        "not in a collective"
    ), head
    assert "ddpkit: the job goes on (DDPKIT_HANG_ACTION=report)" in ranks[0].err
    for rank in ranks[1:]:  # one report, on rank 0
        assert "ddpkit:" not in rank.err, rank.err[-3000:]


@pytest.mark.parametrize(("raw", "end"), [("", False), ("report", False), (" END ", True)])
def test_the_hang_action_is_read_from_the_environment(raw: str, end: bool) -> None:
    bounds = hang.hang_bounds({"DDPKIT_HANG_ACTION": raw}, None, None, world_size=2)
    assert bounds is not None and bounds.end is end


def test_a_bad_hang_action_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"DDPKIT_HANG_ACTION='kill' is not a hang action"):
        hang.hang_bounds({"DDPKIT_HANG_ACTION": "kill"}, None, None, world_size=2)


@pytest.mark.multiproc
def test_ranks_waiting_while_rank_zero_prepares_data_or_writes_a_checkpoint_are_left_alone(
    worker: Path, tmp_path: Path
) -> None:
    # one run, four waits past the tight bound, each for rank 0's useful work: its data
    # preparation before the first step (under the first bound), its slow checkpoint write,
    # its slow copy of the state for a background write, and that write, which
    # wait_for_checkpoint waits for. A longer guard than spawn's 120 s (at a load of 38 on this
    # machine, a merged run passed 120 s); a guard against a hang, not a measure
    extra = ("--dir", str(tmp_path / "ckpt"))
    ranks = _run(worker, "busy", world_size=2, extra=extra, guard_s=240.0)
    assert [rank.code for rank in ranks] == [0, 0], ranks[1].err[-3000:]
    assert all("ddpkit:" not in rank.err for rank in ranks)
    assert all(rank.out.endswith("saved\nsaved in the background\n") for rank in ranks)
    assert len(list((tmp_path / "ckpt").iterdir())) >= 1


def test_the_report_lands_in_the_attempt_folder_and_the_jobs_log_folder(tmp_path: Path) -> None:
    from ddpkit.worker.watchdog.hangwatch import report_paths

    error_file = tmp_path / "run_x" / "attempt_0" / "3" / "error.json"
    logs = tmp_path / "logs"
    assert report_paths({"TORCHELASTIC_ERROR_FILE": str(error_file)}) == [
        str(tmp_path / "run_x" / "attempt_0" / "ddpkit-hang-report.txt")
    ]
    env = {"TORCHELASTIC_ERROR_FILE": str(error_file), "DDPKIT_LOG_DIR": str(logs)}
    assert report_paths({**env, "SLURM_JOB_ID": "77"})[1] == str(logs / "ddpkit-hang-report-77.txt")
    assert report_paths({"DDPKIT_LOG_DIR": str(logs)}) == [str(logs / "ddpkit-hang-report.txt")]
    assert report_paths({"DDPKIT_LOG_DIR": "relative", "TORCHELASTIC_ERROR_FILE": "x"}) == []


def test_the_launchers_summary_quotes_the_report_it_finds(tmp_path: Path) -> None:
    from ddpkit.contract import HANG_REPORT_FILE
    from ddpkit.launch.report import LaunchOutcome, WorkerFailure

    root = WorkerFailure(rank=1, local_rank=1, host="n1", pid=42, exit_code=1)
    outcome = LaunchOutcome(1, root, log_dir=str(tmp_path))
    assert "the job hung" not in outcome.describe()  # no report: the usual summary
    (tmp_path / HANG_REPORT_FILE).write_text("ddpkit: hang: rank 1 ...\nddpkit: stack of rank 1\n")
    lines = outcome.describe().splitlines()
    assert lines[:4] == [
        "ddpkit: worker failed (root cause): rank 1 (local rank 1) on n1: exit code 1",
        f"ddpkit: the job hung; the hang watchdog's report (from {tmp_path / HANG_REPORT_FILE}):",
        "  ddpkit: hang: rank 1 ...",
        "  ddpkit: stack of rank 1",
    ]
    # a report made earlier while the job went on (DDPKIT_HANG_ACTION=report), then a failure
    # of its own: its traceback is the cause, the report is pointed to
    text = "Traceback (most recent call last):\nValueError: x"
    raised = dataclasses.replace(root, traceback=text, source="err.log")
    lines = LaunchOutcome(1, raised, log_dir=str(tmp_path)).describe().splitlines()
    assert lines[1:5] == [
        "ddpkit: traceback of rank 1 (from err.log):",
        "  Traceback (most recent call last):",
        "  ValueError: x",
        f"ddpkit: the hang watchdog reported a hang earlier: {tmp_path / HANG_REPORT_FILE}",
    ]


@pytest.mark.multiproc
def test_ddpkit_run_quotes_the_report_in_its_summary(worker: Path) -> None:
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", str(worker)]
    env = child_env(DDPKIT_PEER_TIMEOUT="3", **BOUNDS)
    done = subprocess.run(
        [*command, "--case", "sleep"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    pids = {
        int(r): int(p) for r, p in re.findall(r"^\[rank\d\]: pid (\d) (\d+)$", done.stdout, re.M)
    }
    assert sorted(pids) == [0, 1], done.stdout
    assert [pid for pid in pids.values() if running(pid)] == []
    assert done.returncode == 1, done.stderr[-3000:]
    summary = done.stderr[done.stderr.index("ddpkit: worker failed (root cause)") :]
    found = re.search(r"the hang watchdog's report \(from (\S+)\):", summary)
    assert found and Path(found.group(1)).name == "ddpkit-hang-report.txt", summary
    assert f"  ddpkit: hang: rank 1 (host {HOST}, pid {pids[1]}) is in " in summary
    assert Path(found.group(1)).read_text().startswith(f"ddpkit: hang: rank 1 (host {HOST}")
