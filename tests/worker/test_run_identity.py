"""The run's identity in a worker: ``ctx.run_id``/``ctx.attempt`` alike on every rank of a real
gloo group (named by the environment, or drawn by rank 0 and agreed), stamped into each
checkpoint and read back with ``ddpkit.checkpoint_origin`` (older checkpoints: no origin)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.worker import ckptfiles
from tests.support.distutil import run_workers, torchrun_env

LEGACY = Path(__file__).resolve().parents[1] / "data" / "checkpoints" / "legacy"


def _identity_worker(rank: int, world_size: int, port: int, extra: dict[str, str]) -> Any:
    context = ddpkit.init(env=torchrun_env(rank, world_size, port, **extra))
    try:
        return context.run_id, context.attempt, context.run.source
    finally:
        ddpkit.shutdown()


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        # nothing names the run: each rank draws its own, rank 0's is agreed on
        ({}, None),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}, ("slurm-77", 1, "slurm")),
        (
            {"TORCHELASTIC_RUN_ID": "r-9", "TORCHELASTIC_RESTART_COUNT": "2"},
            ("r-9", 2, "agent"),
        ),
    ],
)
def test_every_rank_of_a_gloo_group_sees_one_run(
    extra: dict[str, str], expected: tuple[str, int, str] | None
) -> None:
    seen = run_workers(_identity_worker, 3, extra, timeout_s=90)
    assert len(set(seen)) == 1, seen
    if expected is None:
        run_id, attempt, source = seen[0]
        assert run_id.startswith("run-") and (attempt, source) == (0, "fresh")
    else:
        assert seen[0] == expected


def test_a_bad_run_id_fails_init_before_anything_waits() -> None:
    with pytest.raises(ConfigError, match=r"DDPKIT_RUN_ID='a b' is not a usable run id"):
        ddpkit.init(env={"DDPKIT_RUN_ID": "a b"})
    assert torch.distributed.is_initialized() is False


def test_a_checkpoint_records_the_run_and_attempt_that_wrote_it(tmp_path: Path) -> None:
    ddpkit.init(env={"DDPKIT_RUN_ID": "exp-1", "SLURM_RESTART_COUNT": "3"})
    try:
        path = ddpkit.save_checkpoint(tmp_path, {"w": torch.ones(2)}, step=5)
        assert path is not None
        assert path.name == "ckpt-000000005-000000001-exp-1-a3.pt"  # the origin is in the name
        origin = ddpkit.checkpoint_origin(tmp_path)
        assert origin == ckptfiles.Origin(path, 5, "exp-1", 3)
        assert ddpkit.checkpoint_origin(path) == origin  # one file, or the folder's newest
        assert ddpkit.load_checkpoint(tmp_path, {}) == 5  # the load is as before
    finally:
        ddpkit.shutdown()
    # the order is in the name too: a second save is the newest
    ddpkit.init(env={"DDPKIT_RUN_ID": "exp-1", "SLURM_RESTART_COUNT": "4"})
    try:
        with pytest.warns(RuntimeWarning, match=r"higher steps \[5\]"):
            ddpkit.save_checkpoint(tmp_path, {"w": torch.ones(2)}, step=3)
        origin = ddpkit.checkpoint_origin(tmp_path)
        assert origin is not None and (origin.step, origin.attempt) == (3, 4)
        assert [entry.sequence for entry in ckptfiles.written(tmp_path)] == [1, 2]
    finally:
        ddpkit.shutdown()


def test_a_checkpoint_written_in_the_background_records_the_run_and_attempt_too(
    tmp_path: Path,
) -> None:
    ddpkit.init(env={"DDPKIT_RUN_ID": "exp-2", "SLURM_RESTART_COUNT": "2"})
    try:
        path = ddpkit.async_save_checkpoint(tmp_path, {"w": torch.ones(2)}, step=7).wait()
        assert path is not None
        assert ddpkit.checkpoint_origin(tmp_path) == ckptfiles.Origin(path, 7, "exp-2", 2)
    finally:
        ddpkit.shutdown()


def test_no_origin_for_older_checkpoints_empty_folders_and_foreign_files(tmp_path: Path) -> None:
    folder = tmp_path / "legacy"
    shutil.copytree(LEGACY, folder)
    origin = ddpkit.checkpoint_origin(folder)  # older names: no origin, by step among themselves
    assert origin is not None and (origin.step, origin.run_id, origin.attempt) == (500, None, None)
    assert ddpkit.checkpoint_origin(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert ddpkit.checkpoint_origin(tmp_path / "empty") is None
    foreign = tmp_path / "model.pt"  # not named as a checkpoint: its contents are never read
    torch.save({"anything": 1}, foreign)
    assert ddpkit.checkpoint_origin(foreign) is None


def test_a_save_without_init_and_without_a_named_run_records_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("DDPKIT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    path = ddpkit.save_checkpoint(tmp_path, {"w": torch.ones(1)}, step=1)
    assert ddpkit.checkpoint_origin(tmp_path) == ckptfiles.Origin(path, 1, None, None)
    monkeypatch.setenv("DDPKIT_RUN_ID", "named")  # a world of one without init, named
    ddpkit.save_checkpoint(tmp_path, {"w": torch.ones(1)}, step=2)
    origin = ddpkit.checkpoint_origin(tmp_path)
    assert origin is not None and (origin.run_id, origin.attempt) == ("named", 0)
