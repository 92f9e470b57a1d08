"""Checkpoints written in the background, two ranks on a real gloo group: a failed write raises
on every rank (at the next save, sync or async, at a wait, a load, the guard, and at exit: a
write still running when the script ends, waited for in a real interpreter's exit when it
succeeds, and by ranks forked from the fork server and ending as an interpreter does when it
fails; the exit step on forked ranks for the rest), a resume from an async checkpoint is bitwise
the one from a sync checkpoint, and the preemption guard waits for the write before it ends the
job. The failures, the resume and the exit steps
share one launch of 2 ranks, one after the other.

A write is made to fail or to wait through the module's seam (``asyncsave.save_payload``) in
the main rank's process only, or for real (a folder that cannot be created).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import ddpkit
from ddpkit.errors import CheckpointError
from ddpkit.worker import asyncsave, ckptfiles, inflight
from ddpkit.worker.safeload import load_file
from tests.support import spawned
from tests.support.distutil import run_workers, torchrun_env


def _saves(names: list[str]) -> list[tuple[int, int]]:
    """(step, sequence) of each checkpoint name (the run id in it is drawn per run)."""
    found = [ckptfiles.parsed(Path(name)) for name in names]
    return [(entry.step, entry.sequence) for entry in found if entry is not None]


# real ranks that mostly wait for writes, bounds and exits: run beside the SLURM tests (ci/test.sh)
pytestmark = pytest.mark.sidecar

INIT = {"backend": "gloo", "timeout_s": 30.0, "peer_timeout_s": 30.0}
TIMEOUT_S = 120.0
_NEXT = ["async", "sync", "wait", "wait_for_checkpoint", "load"]


def _seam(
    fail_steps: set[int], delay_s: float = 0.0, slow_steps: set[int] | None = None
) -> threading.Event:
    """On this process: the background write waits ``delay_s`` (only for ``slow_steps`` when
    given), then fails for ``fail_steps`` (a write that raises) or writes; the event is set
    once it has ended."""
    ended, real = threading.Event(), asyncsave.save_payload

    def save(folder: Path, payload: dict[str, Any], step: int, keep_last: int) -> Path:
        try:
            if slow_steps is None or step in slow_steps:
                time.sleep(delay_s)  # the moment: the next call may already be waiting
            if step in fail_steps:
                raise OSError(28, f"injected: no space for step {step}")
            return real(folder, payload, step, keep_last)
        finally:
            ended.set()

    asyncsave.save_payload = save  # type: ignore[assignment]  # the spawned worker's own
    return ended


def _failures(rank: int, root: str) -> dict[str, Any]:
    """A write failing at each of _NEXT's calls, at once and while the call waits."""
    folder, found = Path(root) / "ckpt", {}
    step = 0
    for delay_s in (0.0, 0.3):
        for how in _NEXT:
            step += 2
            failing = step - 1
            if rank == 0:
                _seam({failing}, delay_s)
            state = {"w": torch.full((3,), float(step))}
            pending = ddpkit.async_save_checkpoint(folder, state, step=failing)
            try:
                if how == "async":
                    ddpkit.async_save_checkpoint(folder, state, step=step)
                elif how == "sync":
                    ddpkit.save_checkpoint(folder, state, step=step)
                elif how == "wait":
                    pending.wait()
                elif how == "wait_for_checkpoint":
                    ddpkit.wait_for_checkpoint()
                else:
                    ddpkit.load_checkpoint(folder, {})
            except CheckpointError as error:
                cause = error.__cause__
                found[f"{how}@{delay_s}"] = (error.message, type(cause).__name__)
            else:
                found[f"{how}@{delay_s}"] = None
            assert not inflight.in_flight()
            ddpkit.save_checkpoint(folder, state, step=step)  # the group is in step
    return {"errors": found, "newest": ddpkit.load_checkpoint(folder, {}), "step": step}


def _check_failures(rank: int, result: dict[str, Any]) -> None:
    """A failed background write raises on every rank at the next call."""
    assert result["newest"] == result["step"]  # the failed saves left no trace
    assert sorted(result["errors"]) == sorted(f"{h}@{d}" for h in _NEXT for d in (0.0, 0.3))
    for name, error in result["errors"].items():
        assert error is not None, f"rank {rank}: {name} did not raise"
        message, cause = error
        assert "failed to write checkpoint step" in message and "in the background" in message
        assert "injected: no space" in message, message
        assert cause == ("OSError" if rank == 0 else "NoneType")  # rank 0 chains its own


# --- at exit -----------------------------------------------------------------------------------

_EXITING = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import ddpkit
    from ddpkit.worker import asyncsave

    folder, delay_s, timeout_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    rank = int(os.environ["RANK"])
    ddpkit.init(backend="gloo", timeout_s=30.0, peer_timeout_s=30.0)
    real = asyncsave.save_payload

    def slow(*args):
        time.sleep(delay_s)  # still writing when the script ends
        return real(*args)

    asyncsave.save_payload = slow
    ddpkit.async_save_checkpoint(folder, {"w": torch.ones(3)}, step=5, timeout_s=timeout_s)
    print(f"rank {rank} done", flush=True)  # and the script ends without waiting
    """
)


# name: (the folder cannot be made, the write's delay, its timeout_s). A write still running
# when the script ends, both outcomes. "ok-late" in a real interpreter: its exit code is the
# interpreter's own, after finalization. "fails-late" ends in ddpkit's atexit handler itself
# (os._exit(1), before any finalization): its ranks are forked from the fork server, run the
# script as __main__ and end as an interpreter does, its threads then its atexit handlers
# (tests/support/spawned.py's forked). The variations below run ddpkit's exit step on the fork
# server.
EXITS = {
    "ok-late": (False, 1.0, 300.0),
    "fails-late": (True, 1.0, 300.0),
}


@pytest.mark.parametrize("case", EXITS)
def test_at_exit_the_write_is_waited_for_and_a_failure_ends_every_rank_with_1(
    tmp_path: Path, case: str
) -> None:
    fails, delay_s, timeout_s = EXITS[case]
    if fails:
        (tmp_path / "a-file").write_text("not a folder")
    folder = tmp_path / ("a-file" if fails else "ok") / "ckpt"
    script = tmp_path / "exiting.py"
    script.write_text(_EXITING)
    launch = spawned.forked if fails else spawned.spawn
    ranks = launch(
        script, 2, [str(folder), str(delay_s), str(timeout_s)], bound_s=30.0, timeout_s=TIMEOUT_S
    )
    for rank in ranks:
        output = rank.out + rank.err
        assert f"rank {rank.rank} done" in output, output
        _check_exit(case, rank.code, output)
    _check_folder(case, folder)


def _check_exit(case: str, code: int | None, output: str) -> None:
    """What one rank's exit shows: its code (None: no exit step asked for one) and stderr."""
    if case.startswith("fails"):
        assert code == 1, output
        assert "failed to write checkpoint step 5" in output, output
        assert "NotADirectoryError" in output, output
    elif case == "too-slow":
        assert code == 1, output
        assert "checkpoint step 5" in output and "did not finish within 1 s" in output, output
    else:
        assert code in (0, None), output
        assert "error" not in output, output


def _check_folder(case: str, folder: Path) -> None:
    if case.startswith("ok"):
        names = sorted(p.name for p in folder.iterdir())
        assert len(names) == 1 and _saves(names) == [(5, 1)], names
        with pytest.warns(RuntimeWarning, match="saved by 2 ranks"):
            assert ddpkit.load_checkpoint(folder, {}) == 5
    elif case == "too-slow":  # ended mid-wait: no file, at most a dead writer's temporary
        assert not list(folder.glob("ckpt-*.pt"))


# The same exit step (``inflight._at_exit``, what the atexit handler runs first) on forked ranks:
# a write that ended before the exit, well or not, and one slower than its timeout_s.
EXIT_STEPS = {
    "ok-at-once": (False, 0.0, 300.0),
    "fails-at-once": (True, 0.0, 300.0),
    "too-slow": (False, 60.0, 1.0),
}


def _exit_step(folder: str, delay_s: float, timeout_s: float) -> tuple[int | None, str]:
    """ddpkit's exit step for a write that ended (or is slower than ``timeout_s``)."""
    _seam(set(), delay_s)  # each rank's own write (it is the main rank's that counts)
    ddpkit.async_save_checkpoint(folder, {"w": torch.ones(3)}, step=5, timeout_s=timeout_s)
    if delay_s == 0.0:
        time.sleep(0.3)  # the write has ended before the script does
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = inflight._at_exit()
    return code, said.getvalue()


def _exit_step_folder(root: Path, case: str) -> Path:
    """The case's folder: one under a regular file for a write that fails."""
    return root / ("a-file" if EXIT_STEPS[case][0] else case) / "ckpt"


# --- one launch of 2 ranks for the failures, the resume and the exit steps ---------------------


def _ranks_worker(rank: int, world_size: int, port: int, root: str) -> dict[str, Any]:
    """The failures, the resume, then each exit step (too-slow last: its write goes on in the
    background), on one group; each part with the real write back in place."""
    ddpkit.init(env=torchrun_env(rank, world_size, port), **INIT)
    real = asyncsave.save_payload
    try:
        seen: dict[str, Any] = {"failures": _failures(rank, root)}
        asyncsave.save_payload = real
        seen["resume"] = _resume(rank, root)
        for case, (_, delay_s, timeout_s) in EXIT_STEPS.items():
            asyncsave.save_payload = real
            folder = str(_exit_step_folder(Path(root), case))
            seen[case] = _exit_step(folder, delay_s, timeout_s)
        return seen
    finally:
        ddpkit.shutdown()


def test_on_two_ranks_a_failed_write_raises_a_resume_is_bitwise_and_exit_reports(
    tmp_path: Path,
) -> None:
    """One launch: a failed background write raises on every rank at the next call; a resume
    from an async checkpoint is bitwise the one from a sync checkpoint; the exit step reports
    the write's outcome on every rank."""
    (tmp_path / "a-file").write_text("not a folder")
    results = run_workers(_ranks_worker, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    for rank, seen in enumerate(results):
        _check_failures(rank, seen["failures"])
    _check_resume([seen["resume"] for seen in results], tmp_path)
    for case in EXIT_STEPS:
        for code, output in (seen[case] for seen in results):
            _check_exit(case, code, output)
        _check_folder(case, _exit_step_folder(tmp_path, case))


# --- resume: async is sync, bitwise ------------------------------------------------------------


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for _ in steps:
        optimizer.zero_grad()
        features = torch.randn(8, 6)  # from the RNG a checkpoint restores
        model(features).square().mean().backward()
        optimizer.step()


def _fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    inner = torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(32, 2)
    )
    model = ddpkit.wrap(inner)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _resume(rank: int, root: str) -> dict[str, bool]:
    """Trained 3 steps, saved sync and async, 3 more; each resume's 3 steps equal to those."""
    model, optimizer = _fresh(0)
    torch.manual_seed(10 + rank)
    _train(model, optimizer, range(3))
    state = {"model": model, "optimizer": optimizer}
    ddpkit.save_checkpoint(Path(root) / "sync", state, step=3)
    pending = ddpkit.async_save_checkpoint(Path(root) / "async", state, step=3)
    _train(model, optimizer, range(3, 6))  # while the write runs
    pending.wait()
    reference = [p.detach().clone() for p in model.parameters()]
    same = {}
    for kind in ("sync", "async"):
        again, again_optimizer = _fresh(99)  # other weights, other RNG
        resumed = {"model": again, "optimizer": again_optimizer}
        assert ddpkit.load_checkpoint(Path(root) / kind, resumed) == 3
        _train(again, again_optimizer, range(3, 6))
        same[kind] = all(
            torch.equal(a, b) for a, b in zip(again.parameters(), reference, strict=True)
        )
    return same


def _check_resume(results: list[dict[str, bool]], tmp_path: Path) -> None:
    """A resume from an async checkpoint is bitwise the one from a sync checkpoint."""
    assert results == [{"sync": True, "async": True}] * 2
    (sync_file,) = ckptfiles.written(tmp_path / "sync")
    (async_file,) = ckptfiles.written(tmp_path / "async")
    assert (sync_file.step, async_file.step) == (3, 3)
    sync = load_file(sync_file.path, "cpu", [])
    done = load_file(async_file.path, "cpu", [])
    assert sync.keys() == done.keys()
    for key in ("step", "world_size", "state", "rng"):
        assert _equal(sync[key], done[key]), key


def _equal(one: Any, other: Any) -> bool:
    if isinstance(one, torch.Tensor):
        return torch.equal(one, other)
    if isinstance(one, dict):
        return one.keys() == other.keys() and all(_equal(one[k], other[k]) for k in one)
    if isinstance(one, list | tuple):
        return len(one) == len(other) and all(map(_equal, one, other))
    if isinstance(one, numpy.ndarray):
        return bool(numpy.array_equal(one, other))
    return bool(one == other)


# --- the preemption guard waits for the write --------------------------------------------------


def _guard_worker(
    rank: int, world_size: int, port: int, root: str, case: tuple[float, str]
) -> dict[str, Any]:
    """Steps that change a plain state (no DDP, no optimizer: what the guard waits for is the
    write, whatever the state, and neither imports torch._dynamo; test_preempt requeues with a
    DDP model), a background save at steps 2 and 4, the stop signal on rank 1 while step 4 is
    written."""
    delay_s, outcome = case
    fails, timeout_s = {4} if outcome == "fails" else set(), 1.0 if outcome == "slow" else 300.0
    ddpkit.init(env=torchrun_env(rank, world_size, port), **INIT)
    guard = ddpkit.preemption_guard(env={"SLURM_RESTART_COUNT": "0"})  # not SLURM: exit 75
    folder = Path(root) / "ckpt"
    slow = {4} if outcome == "slow" else None
    ended = _seam(fails, delay_s, slow) if rank == 0 else threading.Event()
    state = {"w": torch.zeros(64, 32)}
    try:
        for step in range(1, 10):
            state["w"] += step  # a step's update
            if step in (2, 4):
                ddpkit.async_save_checkpoint(folder, state, step=step, timeout_s=timeout_s)
            if step == 5 and rank == 1:
                os.kill(os.getpid(), signal.SIGUSR2)  # arrives while step 4 is written
            if guard.should_stop():
                try:
                    guard.requeue_and_exit()
                except SystemExit as stop:  # what a requeued job does: it ends here
                    return {
                        "code": stop.code,
                        "step": step,
                        "written": rank != 0 or ended.is_set(),
                        "files": sorted(p.name for p in folder.iterdir()),
                    }
                except CheckpointError as error:
                    return {"error": error.message, "step": step}
        raise AssertionError("never stopped")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # requeue_and_exit ignores it
        ddpkit.shutdown()


@pytest.mark.parametrize(
    ("delay_s", "outcome"), [(0.0, "ok"), (1.5, "ok"), (0.5, "fails"), (60.0, "slow")]
)
def test_the_guard_waits_for_the_write_before_it_ends_the_job(
    tmp_path: Path, delay_s: float, outcome: str
) -> None:
    results = run_workers(_guard_worker, 2, str(tmp_path), (delay_s, outcome), timeout_s=TIMEOUT_S)
    if outcome != "ok":
        expected = "failed to write" if outcome == "fails" else "did not finish within 1 s"
        for result in results:
            assert result["step"] == 5
            assert "checkpoint step 4" in result["error"], result
            assert expected in result["error"], result
        if outcome == "slow":
            return  # the write goes on in the background
        with pytest.warns(RuntimeWarning, match="saved by 2 ranks"):
            assert ddpkit.load_checkpoint(tmp_path / "ckpt", {}) == 2  # the previous one
        return
    for result in results:
        assert result["code"] == 75 and result["step"] == 5 and result["written"], result
        assert len(result["files"]) == 2 and _saves(result["files"]) == [(2, 1), (4, 2)], result
    with pytest.warns(RuntimeWarning, match="saved by 2 ranks"):
        assert ddpkit.load_checkpoint(tmp_path / "ckpt", {}) == 4
