"""Checkpoints of FSDP2 models: saved by every rank through torch.distributed.checkpoint, resumed
at another world size on real gloo groups, and read under ddpkit's trust rule (DCP's pickled
``.metadata`` is unpickled weights-only; a planted one is refused before its payload runs)."""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import ddpkit
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.worker import ckptfiles, durable
from tests.support import tinymlp
from tests.support.distutil import run_workers, torchrun_env

STEPS = 3  # before the save, and again after the resume


def _fsdp(model: torch.nn.Module) -> torch.nn.Module:
    return ddpkit.wrap(model, "fsdp", fsdp_blocks=(tinymlp.Block,))


def _train_and_save(rank: int, world_size: int, port: int, directory: str) -> list[float]:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    try:
        model = _fsdp(tinymlp.make_model())
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        losses = [tinymlp.step(model, optimizer, rank, world_size) for _ in range(STEPS)]
        state = {"model": model, "optimizer": optimizer, "note": "kept"}
        with pytest.raises(ConfigError, match="cannot be saved in the background"):
            ddpkit.async_save_checkpoint(directory, state, step=STEPS)
        ddpkit.save_checkpoint(directory, state, step=STEPS)
        return losses
    finally:
        ddpkit.shutdown()


def _resume_and_train(rank: int, world_size: int, port: int, directory: str) -> list[float]:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    try:
        torch.manual_seed(99)  # other weights than the saved ones: the load must replace them
        model = _fsdp(torch.nn.Sequential(*tinymlp.make_model()))
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer}
        with pytest.warns(RuntimeWarning, match="re-seeded"):
            assert ddpkit.load_checkpoint(directory, state) == STEPS
        assert state["note"] == "kept"
        return [tinymlp.step(model, optimizer, rank, world_size) for _ in range(STEPS)]
    finally:
        ddpkit.shutdown()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """A checkpoint of step 3 saved by 2 ranks, and the losses before it."""
    directory = tmp_path_factory.mktemp("sharded")
    losses = run_workers(_train_and_save, 2, str(directory))
    assert losses[0] == losses[1]
    return directory, losses[0]


def test_saved_at_two_ranks_resumes_at_three_on_the_same_trajectory(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    after = run_workers(_resume_and_train, 3, str(directory))
    assert after[0] == after[1] == after[2]
    expected = tinymlp.reference(2 * STEPS)
    assert saved[1] + after[0] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert after[0][0] < saved[1][-1]  # it went on training, not from scratch


def test_the_checkpoint_is_a_file_and_its_complete_folder(saved: tuple[Path, list[float]]) -> None:
    names = sorted(os.listdir(saved[0]))
    assert len(names) == 2, names  # nothing temporary left
    folder, file = (saved[0] / name for name in names)  # .dcp sorts before .pt
    assert ckptfiles.COMPLETE.fullmatch(file.name) and folder == ckptfiles.shards_of(file)
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_loads_into_a_plain_model_in_one_process(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    """No process group at all: DCP gathers the 2 ranks' shards into whole tensors."""
    model = tinymlp.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer}
    with pytest.warns(RuntimeWarning, match="re-seeded"):
        assert ddpkit.load_checkpoint(saved[0], state) == STEPS
    losses = [tinymlp.step(model, optimizer, 0, 1) for _ in range(STEPS)]
    assert losses == pytest.approx(tinymlp.reference(2 * STEPS)[STEPS:], rel=1e-5, abs=1e-7)


class _Payload:
    """Pickles as a call of ``os.system``: what a planted pickle would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_metadata_is_refused_without_running_it(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    marker = tmp_path / "ran"
    (folder,) = directory.glob("*.dcp")
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    model = tinymlp.make_model()
    state = {"model": model, "optimizer": torch.optim.Adam(model.parameters())}
    with pytest.raises(CheckpointError, match=r"names posix\.system, which ddpkit does not"):
        ddpkit.load_checkpoint(directory, state)
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Payload(marker)))  # the payload does run when unpickled freely
    assert marker.exists()


def test_a_planted_value_is_loaded_weights_only_without_running_it(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    """DCP's planner unpickles non-tensor values (an optimizer's lr) with weights_only=False:
    one pointed at a planted pickle is refused before it runs."""
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    marker = tmp_path / "ran"
    (folder,) = directory.glob("*.dcp")
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # ddpkit's own, from the save
    planted = io.BytesIO()
    torch.save(_Payload(marker), planted)
    (folder / "planted.distcp").write_bytes(planted.getvalue())
    fqn = next(
        key
        for key, value in metadata.state_dict_metadata.items()
        if isinstance(value, BytesStorageMetadata)
    )
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    info.relative_path, info.offset, info.length = "planted.distcp", 0, len(planted.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    model = tinymlp.make_model()
    state = {"model": model, "optimizer": torch.optim.Adam(model.parameters())}
    with pytest.raises(
        CheckpointError, match=rf"\({re.escape(fqn)}\) is refused by a weights-only"
    ):
        ddpkit.load_checkpoint(directory, state)
    assert not marker.exists()


def test_a_metadata_naming_a_file_outside_its_folder_is_refused(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    (folder,) = directory.glob("*.dcp")
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../elsewhere.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    model = tinymlp.make_model()
    with pytest.raises(CheckpointError, match=r"'\.\./elsewhere\.distcp', outside its folder"):
        ddpkit.load_checkpoint(
            directory, {"model": model, "optimizer": torch.optim.Adam(model.parameters())}
        )


def test_a_sharded_checkpoint_needs_its_model_in_the_state(
    saved: tuple[Path, list[float]],
) -> None:
    with pytest.raises(CheckpointError, match="holds the sharded model 'model', and state"):
        ddpkit.load_checkpoint(saved[0], {"optimizer": None})


def test_a_folder_without_its_file_is_not_loaded_and_goes_once_stale(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    (file,) = directory.glob("*.pt")
    orphan = ckptfiles.shards_of(directory / ckptfiles.file_name(9, 99, None))
    shutil.copytree(ckptfiles.shards_of(file), orphan)  # its file never came
    temp = directory / ".ckpt-000000009-0a1b2c3d.dcp.tmp"
    shutil.copytree(ckptfiles.shards_of(file), temp)  # a dead writer's
    model = tinymlp.make_model()
    state = {"model": model, "optimizer": torch.optim.Adam(model.parameters())}
    with pytest.warns(RuntimeWarning, match="re-seeded"):
        assert ddpkit.load_checkpoint(directory, state) == STEPS  # the orphan is no checkpoint
    ckptfiles.remove_stale_temps(directory)
    assert orphan.is_dir() and temp.is_dir()  # fresh: maybe a live writer's
    old = time.time() - durable.STALE_AFTER_S - 60
    for path in (orphan, temp):
        for entry in [path, *path.iterdir()]:
            os.utime(entry, (old, old))
    ckptfiles.remove_stale_temps(directory)
    assert not orphan.exists() and not temp.exists()
    assert ckptfiles.shards_of(file).is_dir()  # a checkpoint's own folder stays
