"""Checkpoint failures reach every rank: no rank waits in a collective for one that raised."""

from __future__ import annotations

import itertools
import random
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.worker import ckptfiles, durable
from ddpkit.worker.checkpoint import CheckpointError
from tests.support.distutil import run_workers, torchrun_env

# A run that hangs in a collective waits for its timeout (30 min); these bound it instead.
_PROMPT_S = 60.0


def _model(seed: int, width: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2)
    )


def _saves(names: list[str]) -> list[tuple[int, int]]:
    """(step, sequence) of ``names``, each a checkpoint's (the run id in it may be drawn)."""
    found = [ckptfiles.parsed(Path(name)) for name in names]
    assert None not in found, names
    return [(entry.step, entry.sequence) for entry in found if entry is not None]


def _names(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def _attempt(action: Any) -> dict[str, Any]:
    """Run ``action``; describe the CheckpointError it raised (anything else fails the test)."""
    start = time.monotonic()
    try:
        action()
    except CheckpointError as error:
        cause = error.__cause__
        return {
            "message": error.message,
            "hint": error.hint,
            "cause": None if cause is None else type(cause).__name__,
            "seconds": time.monotonic() - start,
        }
    raise AssertionError("no CheckpointError")


# --- the main rank cannot write ----------------------------------------------------------------


def _write_failure(rank: int, root: str) -> dict[str, Any]:
    good, blocked = Path(root) / "ckpt", Path(root) / "a-file" / "ckpt"
    model = _model(0)
    ddpkit.save_checkpoint(good, {"model": model}, step=1)
    results = {
        "blocked": _attempt(lambda: ddpkit.save_checkpoint(blocked, {"model": model}, step=2)),
        "unpicklable": _attempt(
            lambda: ddpkit.save_checkpoint(good, {"model": model, "f": lambda: rank}, step=3)
        ),
    }
    after_failures = _names(good)
    ddpkit.save_checkpoint(good, {"model": model}, step=4)  # the group is still in step
    state: dict[str, Any] = {"model": _model(1)}
    return {
        **results,
        "files": after_failures,
        "loaded": ddpkit.load_checkpoint(good, state),
        "weights_ok": torch.equal(state["model"][0].weight, model[0].weight),
    }


# 3 ranks: the main rank, a failing rank that is not the main one, and a rank that only
# learns of the failure (at 2 ranks the failing rank and the main one are all there is).
_WORLD = 3


def _failures_worker(rank: int, world_size: int, port: int, root: str) -> dict[str, Any]:
    """The main rank's write failures, then one rank's failures, on the same group (one
    launch, not one each)."""
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    try:
        seen = {"write": _write_failure(rank, root)}
        seen["one_rank"] = _one_rank(rank, str(Path(root) / "one-rank"))
        return seen
    finally:
        ddpkit.shutdown()


def test_main_rank_write_failure_and_one_rank_failing_raise_on_every_rank(
    tmp_path: Path,
) -> None:
    (tmp_path / "a-file").write_text("a regular file where a directory should be")
    seen = run_workers(_failures_worker, _WORLD, str(tmp_path), timeout_s=_PROMPT_S)
    _check_write_failure([each["write"] for each in seen], tmp_path)
    _check_one_rank([each["one_rank"] for each in seen], tmp_path / "one-rank")


def _check_write_failure(results: list[dict[str, Any]], tmp_path: Path) -> None:
    """A failure of the main rank's write raises on every rank."""
    blocked = tmp_path / "a-file" / "ckpt"
    for rank, result in enumerate(results):
        first, second = result["blocked"], result["unpicklable"]
        assert first["message"].startswith(
            f"the main rank (rank 0) failed to write checkpoint step 2 to {blocked}: "
            "NotADirectoryError"
        ), first
        assert second["message"].startswith(
            f"the main rank (rank 0) failed to write checkpoint step 3 to {tmp_path / 'ckpt'}: "
        ), second
        assert "pickle" in second["message"], second
        assert first["hint"] and second["hint"]
        # rank 0 chains the original error; the others only have its text
        assert first["cause"] == ("NotADirectoryError" if rank == 0 else None), rank
        assert (second["cause"] is not None) == (rank == 0), rank
        assert first["seconds"] < 20 and second["seconds"] < 20, result
        # nothing half-written: the step-3 temporary file is gone, step 1 untouched
        assert _saves(result["files"]) == [(1, 1)], rank
        assert result["loaded"] == 4 and result["weights_ok"], rank


# --- one rank fails, the others would have gone on ---------------------------------------------


class _Refuses:
    """An object whose state_dict() raises (on the rank that holds it)."""

    def state_dict(self) -> dict[str, Any]:
        raise ValueError("no state here")


def _unlistable(folder: Any) -> list[tuple[int, Path]]:
    raise PermissionError(13, "Permission denied", str(folder))


def _one_rank(rank: int, root: str) -> dict[str, Any]:
    directory = Path(root)
    model = _model(0)
    results: dict[str, Any] = {}
    odd: Any = _Refuses() if rank == 1 else {"fine": True}
    results["collect"] = _attempt(
        lambda: ddpkit.save_checkpoint(directory, {"model": model, "odd": odd}, step=1)
    )
    ddpkit.save_checkpoint(directory, {"model": model}, step=2)
    other = _model(0, width=16 if rank == 1 else 8)  # rank 1's model does not fit
    results["restore"] = _attempt(lambda: ddpkit.load_checkpoint(directory, {"model": other}))
    if rank == 2:  # rank 2 cannot list the directory
        original, ckptfiles.written = ckptfiles.written, _unlistable
    try:
        results["list"] = _attempt(lambda: ddpkit.load_checkpoint(directory, {}))
    finally:
        if rank == 2:
            ckptfiles.written = original
    state: dict[str, Any] = {"model": _model(1)}
    results["loaded"] = ddpkit.load_checkpoint(directory, state)  # still in step
    results["weights_ok"] = torch.equal(state["model"][0].weight, model[0].weight)
    return results


def _check_one_rank(results: list[dict[str, Any]], tmp_path: Path) -> None:
    """One rank failing (the others would have gone on) raises on every rank."""
    for rank, result in enumerate(results):
        collect, restore, listing = result["collect"], result["restore"], result["list"]
        assert collect["message"].startswith(
            f"rank 1 could not collect its state for checkpoint step 1 in {tmp_path}: "
            "rank 1: ValueError: no state here"
        ), collect
        assert restore["message"].startswith(
            f"rank 1 could not restore checkpoint step 2 from {tmp_path}: rank 1: RuntimeError: "
        ), restore
        assert "size mismatch" in restore["message"], restore
        assert listing["message"].startswith(
            f"rank 2 could not read the checkpoints in {tmp_path}: rank 2: PermissionError: "
        ), listing
        for attempt, failing in ((collect, 1), (restore, 1), (listing, 2)):
            assert attempt["hint"] and attempt["seconds"] < 20, attempt
            assert (attempt["cause"] is not None) == (rank == failing), (rank, attempt)
        assert result["loaded"] == 2 and result["weights_ok"], rank
    assert _saves(_names(tmp_path)) == [(2, 1)]  # the failed step 1 wrote nothing


# --- a world of one ----------------------------------------------------------------------------


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


def test_write_failure_in_a_world_of_one(world_of_one: ddpkit.Context, tmp_path: Path) -> None:
    ddpkit.save_checkpoint(tmp_path, {"w": torch.ones(3)}, step=1)
    with pytest.raises(CheckpointError, match="failed to write checkpoint step 2") as caught:
        ddpkit.save_checkpoint(tmp_path, {"w": torch.ones(3), "f": lambda: 0}, step=2)
    assert caught.value.__cause__ is not None and caught.value.hint
    assert _saves(_names(tmp_path)) == [(1, 1)]


def test_prune_failure_only_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(folder: Path, doomed: list[Path]) -> None:
        raise PermissionError(13, "Permission denied", str(folder))

    ddpkit.save_checkpoint(tmp_path, {"step": 1}, step=1, keep_last=1)
    monkeypatch.setattr(ckptfiles, "prune", refuse)
    with pytest.warns(RuntimeWarning, match="step 2 is saved .* could not be deleted"):
        ddpkit.save_checkpoint(tmp_path, {"step": 2}, step=2, keep_last=1)
    assert _names(tmp_path) == ["ckpt-000000001-000000001.pt", "ckpt-000000002-000000002.pt"]
    monkeypatch.undo()
    ddpkit.save_checkpoint(tmp_path, {"step": 3}, step=3, keep_last=1)
    assert _names(tmp_path) == ["ckpt-000000003-000000003.pt"]


# --- the write path ----------------------------------------------------------------------------


def test_writeback_hints_cover_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ranges: list[tuple[int, int]] = []
    monkeypatch.setattr(durable, "_WRITEBACK_CHUNK", 2**18)
    monkeypatch.setattr(
        durable, "_sync_file_range", lambda: lambda fd, begin, end: ranges.append((begin, end))
    )
    weights = torch.randn(2**19)  # 2 MB
    path = ddpkit.save_checkpoint(tmp_path, {"w": weights}, step=1)
    assert path is not None
    size = path.stat().st_size
    # one hint per 256 KB, the 2 MB tensor written in pieces, contiguous from the start
    assert [end - begin for begin, end in ranges] == [2**18] * (size // 2**18)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)) and ranges[0][0] == 0
    state: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(tmp_path, state) == 1 and torch.equal(state["w"], weights)


def test_real_writeback_hint_is_harmless(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(durable, "_WRITEBACK_CHUNK", 2**16)
    weights = torch.randn(2**18)
    ddpkit.save_checkpoint(tmp_path, {"w": weights}, step=1)
    state: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(tmp_path, state) == 1 and torch.equal(state["w"], weights)


@pytest.mark.parametrize(
    ("written", "step", "keep_last", "doomed"),
    [
        ([1, 2, 3], 4, 3, [1]),
        ([1, 2, 3], 4, 1, [1, 2, 3]),
        ([1, 2], 3, 3, []),
        ([1, 2, 3, 4, 5], 3, 3, [3, 1, 2]),  # step 3 is saved again: replaced
        ([5, 6], 1, 2, [5]),  # write order, not steps: 6 was written last and stays
        ([5, 6, 1], 2, 3, [5]),  # a run restarted after step 6
        ([1, 2, "old 9"], 3, 3, [9]),  # an older ddpkit's name: the oldest, whatever its step
    ],
)
def test_doomed_are_the_files_the_save_replaces_or_prunes(
    tmp_path: Path, written: list[int | str], step: int, keep_last: int, doomed: list[int]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the higher-step notices of the setup
        for number in written:
            if isinstance(number, str):
                (tmp_path / f"ckpt-{int(number.split()[1]):09d}.pt").write_bytes(b"x")
            else:
                ddpkit.save_checkpoint(tmp_path, {}, step=number, keep_last=10)
    found = ckptfiles.doomed(ckptfiles.written(tmp_path), step, keep_last)
    assert [entry.step for entry in found] == doomed


# --- a group plain torch created (no ddpkit.init()) ---------------------------------------------


def _streams() -> list[Any]:
    """The next draws of every RNG a checkpoint restores (python, numpy, torch)."""
    return [random.random(), numpy.random.rand(2).tolist(), torch.rand(3).tolist()]


def _plain_group_worker(rank: int, world_size: int, port: int, root: str) -> dict[str, Any]:
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
    try:
        directory, last = Path(root), world_size - 1
        random.seed(100 + rank)
        numpy.random.seed(200 + rank)
        torch.manual_seed(300 + rank)
        model = _model(0)
        odd: Any = _Refuses() if rank == last else {"fine": True}
        results: dict[str, Any] = {
            "collect": _attempt(
                lambda: ddpkit.save_checkpoint(directory, {"model": model, "odd": odd}, step=1)
            )
        }
        path = ddpkit.save_checkpoint(directory, {"model": model, "rank_seen": rank}, step=5)
        results["path"] = None if path is None else path.name
        results["files"] = _names(directory)  # save returns once the file is in place
        results["expected"] = _streams()
        random.seed(0)
        numpy.random.seed(0)
        torch.manual_seed(0)
        state: dict[str, Any] = {"model": _model(1)}
        results["loaded"] = ddpkit.load_checkpoint(directory, state)
        results["streams"] = _streams()
        results["rank_seen"] = state["rank_seen"]
        results["weights_ok"] = torch.equal(state["model"][0].weight, model[0].weight)
        other = _model(0, width=16 if rank == last else 8)  # the last rank's model does not fit
        results["restore"] = _attempt(lambda: ddpkit.load_checkpoint(directory, {"model": other}))
        return results
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_a_group_plain_torch_created(tmp_path: Path) -> None:
    world_size = _WORLD
    results = run_workers(_plain_group_worker, world_size, str(tmp_path), timeout_s=_PROMPT_S)
    last = world_size - 1
    # every rank's own RNG streams, distinct, saved and given back to their own rank
    assert len({repr(result["expected"]) for result in results}) == world_size
    for rank, result in enumerate(results):
        assert result["path"] == (results[0]["files"][0] if rank == 0 else None), rank
        assert _saves(result["files"]) == [(5, 1)], rank  # one writer, no stray files
        assert result["loaded"] == 5 and result["weights_ok"], rank
        assert result["streams"] == result["expected"], rank
        assert result["rank_seen"] == 0, rank  # the main rank's values are the saved ones
        collect, restore = result["collect"], result["restore"]
        assert collect["message"].startswith(
            f"rank {last} could not collect its state for checkpoint step 1 in {tmp_path}: "
            f"rank {last}: ValueError: no state here"
        ), collect
        assert restore["message"].startswith(
            f"rank {last} could not restore checkpoint step 5 from {tmp_path}: rank {last}: "
        ), restore
        for attempt in (collect, restore):  # the failing rank chains its own error
            assert (attempt["cause"] is not None) == (rank == last), (rank, attempt)
            assert attempt["seconds"] < 20, attempt
    assert _saves(_names(tmp_path)) == [(5, 1)]
