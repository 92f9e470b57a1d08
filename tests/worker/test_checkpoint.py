"""ddpkit.save_checkpoint / load_checkpoint: atomic files, keep-last, fallback, RNG, kill -9."""

from __future__ import annotations

import os
import random
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import ddpkit
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.worker import checkpoint, ckptfiles, durable
from ddpkit.worker.checkpoint import checkpoint_files
from tests.support.distutil import run_workers, torchrun_env


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _names(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def _ckpt(step: int, sequence: int) -> str:
    """The name of save number ``sequence`` of ``step`` by no named run (no init, no run id)."""
    return ckptfiles.file_name(step, sequence, None)


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


def test_round_trip_without_init(tmp_path: Path) -> None:
    model, optimizer = _trained(0)
    path = ddpkit.save_checkpoint(
        tmp_path, {"model": model, "optim": optimizer, "epoch": 3, "t": torch.arange(4)}, step=7
    )
    assert path == tmp_path / "ckpt-000000007-000000001.pt" and _names(tmp_path) == [path.name]
    fresh, fresh_optimizer = _model(1), torch.optim.Adam(_model(1).parameters(), lr=0.5)
    state: dict[str, Any] = {"model": fresh, "optim": fresh_optimizer, "epoch": 0}
    assert ddpkit.load_checkpoint(tmp_path, state) == 7
    assert state["epoch"] == 3 and torch.equal(state["t"], torch.arange(4))
    for mine, theirs in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
    assert fresh_optimizer.state_dict()["param_groups"][0]["lr"] == 0.1
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1


def test_wrapped_model_is_saved_unwrapped(world_of_one: ddpkit.Context, tmp_path: Path) -> None:
    model = _model(0)
    ddpkit.save_checkpoint(tmp_path, {"model": torch.nn.DataParallel(model)}, step=1)
    saved = torch.load(checkpoint_files(tmp_path)[-1], weights_only=False)
    assert list(saved["state"]["model"]) == list(model.state_dict())  # no "module." prefix
    bare, wrapped = _model(5), torch.nn.DataParallel(_model(6))
    assert ddpkit.load_checkpoint(tmp_path, {"model": bare}) == 1
    assert ddpkit.load_checkpoint(tmp_path, {"model": wrapped}) == 1
    for loaded in (bare, wrapped.module):
        assert torch.equal(loaded[0].weight, model[0].weight)


def test_no_checkpoint_leaves_state_untouched(tmp_path: Path) -> None:
    state: dict[str, Any] = {"epoch": 4}
    assert ddpkit.load_checkpoint(tmp_path / "missing", state) is None  # a fresh run's folder
    assert ddpkit.load_checkpoint(tmp_path, state) is None  # empty
    (tmp_path / ".ckpt-000000002.pt.abc.tmp").write_bytes(b"half")  # a killed writer's file
    assert ddpkit.load_checkpoint(tmp_path, state) is None
    assert state == {"epoch": 4}


# --- one checkpoint file instead of the folder -------------------------------------------------


def test_a_checkpoint_file_loads_exactly_that_file(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        ddpkit.save_checkpoint(
            tmp_path, {"at": step, "w": torch.full((3,), float(step))}, step=step
        )
    state: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(tmp_path / _ckpt(2, 2), state) == 2  # not the newest
    assert state["at"] == 2 and torch.equal(state["w"], torch.full((3,), 2.0))
    assert ddpkit.load_checkpoint(str(tmp_path / _ckpt(3, 3)), state) == 3
    assert state["at"] == 3


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"checkpoint file .*ckpt-000000002-000000002\.pt cannot be loaded"),
        (b"garbage" * 10, r"checkpoint file .*ckpt-000000002-000000002\.pt cannot be loaded"),
        ("half", r"checkpoint file .*ckpt-000000002-000000002\.pt cannot be loaded"),
        ("model", r"ckpt-000000002-000000002\.pt was not written by ddpkit\.save_checkpoint"),
    ],
)
def test_a_checkpoint_file_that_does_not_load_is_an_error(
    tmp_path: Path, content: bytes | str, match: str
) -> None:
    ddpkit.save_checkpoint(tmp_path, {"at": 1}, step=1)
    ddpkit.save_checkpoint(tmp_path, {"at": 2, "w": torch.ones(1000)}, step=2)
    path = tmp_path / _ckpt(2, 2)
    if content == "half":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif content == "model":
        torch.save({"weight": torch.ones(2)}, path)  # a plain torch.save, not ours
    else:
        assert isinstance(content, bytes)
        path.write_bytes(content)
    state: dict[str, Any] = {"at": 0}
    with pytest.raises(CheckpointError, match=match) as caught:
        ddpkit.load_checkpoint(path, state)  # never step 1 instead: that was not asked for
    assert caught.value.hint and state == {"at": 0}


@pytest.mark.parametrize("name", ["ckpt-000000004.pt", "model.pt", "weights.pth"])
def test_a_missing_checkpoint_file_is_an_error(tmp_path: Path, name: str) -> None:
    ddpkit.save_checkpoint(tmp_path, {"at": 1}, step=1)
    with pytest.raises(CheckpointError, match=f"checkpoint file .*{name} does not exist") as got:
        ddpkit.load_checkpoint(tmp_path / name, {})  # pruned, or a typo: not a fresh start
    assert str(tmp_path) in (got.value.hint or "")


def test_a_path_that_is_neither_file_nor_folder_is_an_error(tmp_path: Path) -> None:
    fifo = tmp_path / "ckpt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="neither a checkpoint folder nor a checkpoint file"):
        ddpkit.load_checkpoint(fifo, {})


def test_keep_last_and_stray_temp_files(tmp_path: Path) -> None:
    stray = tmp_path / ".ckpt-000000009.pt.x1y2.tmp"  # a name of ddpkit before host names
    stray.write_bytes(b"left by a kill -9")
    day_ago = time.time() - 86400
    os.utime(stray, (day_ago, day_ago))  # not written for a day: its writer is gone
    for step in range(1, 6):
        ddpkit.save_checkpoint(tmp_path, {"step": step}, step=step, keep_last=2)
    assert _names(tmp_path) == [_ckpt(4, 4), _ckpt(5, 5)]
    ddpkit.save_checkpoint(tmp_path, {"step": 6}, step=6, keep_last=1)
    assert [path.name for path in checkpoint_files(tmp_path)] == [_ckpt(6, 6)]
    state: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(tmp_path, state) == 6 and state["step"] == 6


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_unloadable_newest_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    for step in (10, 20):
        ddpkit.save_checkpoint(tmp_path, {"w": torch.full((1000,), float(step))}, step=step)
    newest = tmp_path / _ckpt(20, 2)
    data = newest.read_bytes()
    newest.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage": b"\x00" * 100, "empty": b""}[damage]
    )
    state: dict[str, Any] = {}
    with pytest.warns(RuntimeWarning, match=_ckpt(20, 2)):
        assert ddpkit.load_checkpoint(tmp_path, state) == 10
    assert torch.equal(state["w"], torch.full((1000,), 10.0))


def test_rng_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(1)
    random.seed(2)
    numpy.random.seed(3)
    ddpkit.save_checkpoint(tmp_path, {}, step=0)
    expected = (torch.rand(3), random.random(), numpy.random.rand(2))
    torch.manual_seed(99)
    random.seed(99)
    numpy.random.seed(99)
    assert ddpkit.load_checkpoint(tmp_path, {}) == 0
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1]
    assert numpy.array_equal(numpy.random.rand(2), expected[2])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"step": -1}, "step=-1"), ({"step": 1, "keep_last": 0}, "keep_last=0")],
)
def test_save_rejects(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        ddpkit.save_checkpoint(tmp_path, {}, **kwargs)
    assert caught.value.hint


# --- the newest written wins ------------------------------------------------------------------


def _run(directory: Path, steps: list[int], keep_last: int, tag: str) -> list[Path | None]:
    """Save ``steps`` in order, each holding its step and ``tag`` (which run wrote it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the higher-step notice is tested on its own
        return [
            ddpkit.save_checkpoint(directory, {"run": tag, "at": n}, step=n, keep_last=keep_last)
            for n in steps
        ]


def _loaded(directory: Path) -> tuple[int | None, Any]:
    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skipped damaged files: tested on their own
        step = ddpkit.load_checkpoint(directory, state)
    return step, (state.get("run"), state.get("at"))


def _steps(directory: Path) -> list[int]:
    return [int(path.name[5:14]) for path in checkpoint_files(directory)]  # write order


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_restart_from_scratch_in_a_used_folder(tmp_path: Path, keep_last: int) -> None:
    _run(tmp_path, [100, 200, 300, 400, 500], keep_last, "old")
    with pytest.warns(RuntimeWarning, match=r"step 100 is saved .* higher steps \[.*500\]"):
        first = ddpkit.save_checkpoint(
            tmp_path, {"run": "new", "at": 100}, step=100, keep_last=keep_last
        )
    assert first is not None and first.is_file()  # not pruned for the old run's steps
    assert _loaded(tmp_path) == (100, ("new", 100))  # never the old run's step 500
    order = [*[200, 300, 400, 500][-keep_last:], 100][-keep_last:]  # write order, oldest first
    assert _steps(tmp_path) == order
    for step in (200, 300, 400, 500, 600):
        (path,) = _run(tmp_path, [step], keep_last, "new")
        assert path is not None and path.is_file()
        assert _loaded(tmp_path) == (step, ("new", step))
        order = [*[n for n in order if n != step], step][-keep_last:]  # the latest saves
        assert _steps(tmp_path) == order
    assert order == list(range(700 - 100 * keep_last, 700, 100))  # the old run's all pruned
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []


@pytest.mark.parametrize("keep_last", [1, 3])
def test_resume_from_an_older_checkpoint_after_the_newest_is_damaged(
    tmp_path: Path, keep_last: int
) -> None:
    _run(tmp_path, [10, 20, 30], keep_last, "first")
    newest = tmp_path / _ckpt(30, 3)
    newest.write_bytes(newest.read_bytes()[:100])  # damaged
    with pytest.warns(RuntimeWarning, match=_ckpt(30, 3)):
        resumed = ddpkit.load_checkpoint(tmp_path, {})
    assert resumed == (20 if keep_last == 3 else None)  # keep_last=1: nothing else to load
    start = 0 if resumed is None else resumed
    # a save tells a damaged file only by reading it, which it does not: the damaged file keeps
    # its place in the write order (a load skips it) until a later save of its step replaces it
    # or keep_last prunes it; the file just written is never the one pruned
    order = [10, 20, 30][-keep_last:]
    for step in range(start + 5, start + 30, 5):  # a different cadence after the restart
        (path,) = _run(tmp_path, [step], keep_last, "second")
        assert path is not None and path.is_file(), step
        assert _loaded(tmp_path) == (step, ("second", step))
        order = [*[n for n in order if n != step], step][-keep_last:]
        assert _steps(tmp_path) == order, step


@pytest.mark.parametrize("keep_last", [1, 3])
def test_fine_tune_that_resets_the_step(tmp_path: Path, keep_last: int) -> None:
    _run(tmp_path, [1000, 2000, 3000], keep_last, "pretrain")
    assert _loaded(tmp_path) == (3000, ("pretrain", 3000))
    for step in (0, 50, 100):
        (path,) = _run(tmp_path, [step], keep_last, "finetune")
        assert path is not None and path.is_file()
        assert _loaded(tmp_path) == (step, ("finetune", step))  # a requeue resumes the fine-tune
    written = [3000, 0, 50, 100] if keep_last == 3 else [100]
    assert _steps(tmp_path) == written[-keep_last:]


def test_files_saved_before_the_write_order_are_older(tmp_path: Path) -> None:
    # A format-1 file (ddpkit before the sequence): loadable, and older than any later save.
    rng = [checkpoint._rng_state()]
    torch.save(
        {"format": 1, "step": 500, "world_size": 1, "state": {"run": "old"}, "rng": rng},
        tmp_path / "ckpt-000000500.pt",
    )
    state: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(tmp_path, state) == 500 and state["run"] == "old"
    _run(tmp_path, [100], 3, "new")
    assert _loaded(tmp_path) == (100, ("new", 100))
    assert _steps(tmp_path) == [500, 100]


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        path = ddpkit.save_checkpoint(tmp_path, {"w": torch.ones(2)}, step=1)
        torch.save({}, tmp_path / "plain.pt")
    finally:
        os.umask(previous)
    assert path is not None
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode == 0o666 & ~umask == stat.S_IMODE((tmp_path / "plain.pt").stat().st_mode)


# --- kill -9 during a write --------------------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    import ddpkit

    class Slow:
        # Pickling it happens inside torch.save, with the temporary file already open.
        def __reduce__(self):
            Path(sys.argv[2]).write_text("writing")
            time.sleep(120)
            return (dict, ())

    directory = sys.argv[1]
    ddpkit.save_checkpoint(directory, {"w": torch.full((4,), 1.0)}, step=1)
    big = torch.randn(8 * 1024 * 1024)  # 32 MB
    ddpkit.save_checkpoint(directory, {"big": big, "slow": Slow()}, step=2)
    """
)


def test_kill_9_during_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory), str(marker)])
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert writer.poll() is None, f"writer exited early with {writer.returncode}"
            assert time.monotonic() < deadline, "the writer never reached the second save"
            time.sleep(0.05)
        temps = [name for name in _names(directory) if name.endswith(".tmp")]
        assert temps and temps[0].startswith(f".{_ckpt(2, 2)}.")  # mid-write of step 2
        os.kill(writer.pid, signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert _names(directory) == sorted([_ckpt(1, 1), *temps])  # the temp file stays
    state: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(directory, state) == 1
    assert torch.equal(state["w"], torch.full((4,), 1.0))
    dead_since = time.time() - durable.BEAT_STALE_AFTER_S - 60  # the time a restart takes
    for temp in temps:
        os.utime(directory / temp, (dead_since, dead_since))
    ddpkit.save_checkpoint(directory, {"w": torch.zeros(1)}, step=3)
    assert _names(directory) == [_ckpt(1, 1), _ckpt(3, 2)]


# --- world size 2, spawned ---------------------------------------------------------------------


def _two_rank_worker(rank: int, world_size: int, port: int, directory: str) -> dict[str, Any]:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    try:
        torch.manual_seed(100 + rank)  # every rank its own stream
        model = _model(0)
        path = ddpkit.save_checkpoint(directory, {"model": model, "rank_seen": rank}, step=5)
        expected = torch.rand(4)
        torch.manual_seed(0)
        fresh = _model(7)
        state: dict[str, Any] = {"model": fresh}
        step = ddpkit.load_checkpoint(directory, state)
        from_file = ddpkit.load_checkpoint(checkpoint_files(directory)[-1], {})
        return {
            "from_file": from_file,
            "path": None if path is None else path.name,
            "origin": ddpkit.checkpoint_origin(directory),
            "step": step,
            "rng_ok": torch.equal(torch.rand(4), expected),
            "weights_ok": torch.equal(fresh[0].weight, model[0].weight),
            "rank_seen": state["rank_seen"],
            "files": _names(Path(directory)),
        }
    finally:
        ddpkit.shutdown()


def test_two_ranks_each_get_their_own_rng(tmp_path: Path) -> None:
    results = run_workers(_two_rank_worker, 2, str(tmp_path))
    origin = results[0]["origin"]
    name = f"ckpt-000000005-000000001-{origin.run_id}-a0.pt"  # the run the ranks agreed on
    assert origin.run_id and [result["path"] for result in results] == [name, None]
    for result in results:
        assert result["origin"] == origin  # every rank reads it from the name alike
        assert result["step"] == 5 and result["rng_ok"] and result["weights_ok"]
        assert result["from_file"] == 5
        assert result["rank_seen"] == 0  # the main rank's values are the saved ones
        assert result["files"] == [name]  # the barrier: written before return


def test_world_size_change_reseeds_rng_deterministically_with_warning(tmp_path: Path) -> None:
    run_workers(_two_rank_worker, 2, str(tmp_path))
    draws = []
    for before in (4, 5):  # whatever the RNGs held before the load
        random.seed(before)
        torch.manual_seed(before)
        with pytest.warns(RuntimeWarning, match="saved by 2 ranks.*re-seeded") as caught:
            assert ddpkit.load_checkpoint(tmp_path, {}) == 5
        draws.append((torch.rand(2).tolist(), random.random(), str(caught[0].message)))
    assert draws[0] == draws[1]  # the same resume, the same streams
    (seed,) = re.findall(r"seed (\d+)", draws[0][2])
    torch.manual_seed(int(seed))
    assert torch.rand(2).tolist() == draws[0][0]
    saved = torch.load(checkpoint_files(tmp_path)[-1], weights_only=False)["rng"]
    for rank in (0, 1):  # and not the saved stream of any rank
        torch.set_rng_state(saved[rank]["torch"])
        assert torch.rand(2).tolist() != draws[0][0]
    seeds = {checkpoint._resized_seed(saved, 5, 3, rank) for rank in range(3)}
    assert len(seeds) == 3 and int(seed) == checkpoint._resized_seed(saved, 5, 1, 0)


def test_a_file_name_with_a_trailing_newline_is_not_a_checkpoint(tmp_path: Path) -> None:
    torch.save({"not": "ours"}, tmp_path / "ckpt-000000009.pt\n")
    (tmp_path / "ckpt-000000001.pt").write_bytes(b"")
    assert [p.name for p in checkpoint_files(tmp_path)] == ["ckpt-000000001.pt"]
