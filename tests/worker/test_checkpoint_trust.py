"""Checkpoint folders others can write to: nothing in them runs, on save or on load.

A planted file is a real pickle whose unpickling would run code (``__reduce__`` returning
``os.system`` or ``exec``) that creates a marker file: the marker must never appear, whether the
job only saves, loads a newer legitimate checkpoint, or finds the planted file claiming to be
the newest (then the load is refused with a one-line error). The user's own types load only
when trusted explicitly; checkpoints written before loads were ``weights_only`` still load,
bitwise.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import ddpkit
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.worker.checkpoint import checkpoint_files
from tests.support.distutil import run_workers, torchrun_env

LEGACY = Path(__file__).resolve().parents[1] / "data" / "checkpoints" / "legacy"


class _System:
    """Unpickling it runs ``touch <marker>`` through os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class _Exec:
    """Unpickling it runs Python code (builtins.exec) that creates the marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def planted_name(kind: str) -> str:
    """The name a planted file of ``kind`` takes: a forged one claims to be the newest save
    (save number 1000 in a folder of a few), the others take the name of an older ddpkit."""
    return "ckpt-000000999-000001000.pt" if kind.startswith("forged") else "ckpt-000000999.pt"


def _plant(path: Path, kind: str, marker: Path) -> Path:
    """A malicious ``path``: ``kind`` says how it is made and how much of ddpkit's payload it
    forges ("forged": a ddpkit checkpoint's shape, a global inside its state)."""
    evil: Any = _System(marker) if kind.endswith("system") else _Exec(marker)
    if kind.startswith("pickle"):  # a plain pickle, not torch's zip
        path.write_bytes(pickle.dumps({"step": 1, "state": evil}))
    elif kind.startswith("torch"):  # torch.save, nothing of ddpkit's header
        torch.save({"state": evil}, path)
    else:  # forged: ddpkit's header, then the payload
        header = {"format": 3, "step": 999, "world_size": 1}
        torch.save({**header, "state": {"x": evil}, "rng": []}, path)
    return path


KINDS = ["pickle-system", "torch-exec", "torch-system", "forged-exec", "forged-system"]


@pytest.mark.parametrize("kind", KINDS)
def test_saving_never_unpickles_a_planted_file(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "marker"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _plant(folder / planted_name(kind), kind, marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the higher-step notice
        for step in (1, 2):
            ddpkit.save_checkpoint(folder, {"w": torch.ones(2) * step}, step=step)
    assert not marker.exists(), "saving ran code from a planted file"


@pytest.mark.parametrize("kind", ["pickle-system", "torch-exec", "torch-system"])
def test_load_takes_the_legit_checkpoint_and_never_runs_the_planted_one(
    tmp_path: Path, kind: str
) -> None:
    marker = tmp_path / "marker"
    folder = tmp_path / "ckpt"
    newest = ddpkit.save_checkpoint(folder, {"w": torch.ones(2)}, step=5)
    # planted after the save, with a higher step, under an older ddpkit's name: older than
    # every save named with its place in the write order, so the load never reaches it
    planted = _plant(folder / planted_name(kind), kind, marker)
    state: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(folder, state) == 5
    assert torch.equal(state["w"], torch.ones(2))
    assert not marker.exists(), "loading ran code from a planted file"
    assert newest is not None
    newest.unlink()  # alone, it is the newest: the weights-only load is the one reader
    if kind.startswith("pickle"):  # an opcode it does not know: skipped as damaged
        with pytest.warns(RuntimeWarning, match=rf"skipping checkpoint {planted}"):
            assert ddpkit.load_checkpoint(folder, {}) is None
    else:  # torch's file: the global refused, in one line
        with pytest.raises(CheckpointError) as caught:
            ddpkit.load_checkpoint(folder, {})
        message = str(caught.value)
        assert f"checkpoint {planted} holds " in message and "\n" not in message, message
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["forged-exec", "forged-system"])
@pytest.mark.parametrize("as_file", [False, True], ids=["folder", "file"])
def test_a_planted_file_that_claims_to_be_newest_is_refused(
    tmp_path: Path, kind: str, as_file: bool
) -> None:
    marker = tmp_path / "marker"
    folder = tmp_path / "ckpt"
    ddpkit.save_checkpoint(folder, {"w": torch.ones(2)}, step=5)
    planted = _plant(folder / planted_name(kind), kind, marker)
    assert [path.name for path in checkpoint_files(folder)][-1] == (
        planted.name
    )  # it does claim to be the newest
    state: dict[str, Any] = {"w": None}
    with pytest.raises(CheckpointError) as caught:
        ddpkit.load_checkpoint(planted if as_file else folder, state)
    name = "posix.system" if kind.endswith("system") else "builtins.exec"
    message = str(caught.value)
    assert f"checkpoint {planted} holds {name}, which load_checkpoint does not unpickle" in message
    assert "trusted_types" in (caught.value.hint or "") and "\n" not in message
    assert not marker.exists(), "loading ran code from a planted file"
    assert state == {"w": None}  # nothing restored


# --- the user's own types ----------------------------------------------------------------------


@dataclass
class RunConfig:
    """A user's own class in the checkpointed state."""

    lr: float
    name: str


def test_own_types_need_trusting_and_then_load(tmp_path: Path) -> None:
    config = RunConfig(lr=0.1, name="run")
    ddpkit.save_checkpoint(tmp_path, {"config": config, "best": numpy.float64(0.5)}, step=3)
    state: dict[str, Any] = {}
    allowed = torch.serialization.get_safe_globals()
    with pytest.raises(CheckpointError) as caught:
        ddpkit.load_checkpoint(tmp_path, state)
    message = caught.value.message
    # every refused global is named at once, so one retry is enough
    assert f"{RunConfig.__module__}.RunConfig" in message
    assert "numpy._core.multiarray.scalar" in message or "numpy.core" in message
    assert "trusted_types=[" in (caught.value.hint or "")
    assert state == {}
    scalar = numpy.float64(0).__reduce__()[0]  # numpy's scalar rebuild function
    trusted = [RunConfig, scalar, type(numpy.dtype(numpy.float64))]
    assert ddpkit.load_checkpoint(tmp_path, state, trusted_types=trusted) == 3
    assert state["config"] == config and state["best"] == 0.5
    # the trust was for that load only: torch's allow-list is as it was
    # the same entries (torch keeps them in a set: their order is not kept across a restore)
    assert set(torch.serialization.get_safe_globals()) == set(allowed)
    with pytest.raises(CheckpointError, match="RunConfig"):
        ddpkit.load_checkpoint(tmp_path, {})


def test_the_allow_list_is_restored_exactly(tmp_path: Path) -> None:
    ddpkit.save_checkpoint(tmp_path, {"config": RunConfig(0.1, "x")}, step=1)
    allowed = torch.serialization.get_safe_globals()  # torch's own entries
    torch.serialization.add_safe_globals([RunConfig, numpy.ndarray])  # the user's own, global
    try:
        assert ddpkit.load_checkpoint(tmp_path, {}) == 1  # trusted by the user already
        after = torch.serialization.get_safe_globals()
        assert set(after) == {*allowed, RunConfig, numpy.ndarray}  # ndarray is ddpkit's too
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(allowed)


@pytest.mark.parametrize("trusted", ["RunConfig", [RunConfig(0.1, "x")], [("x", 3)], 5])
def test_trusted_types_must_be_types(tmp_path: Path, trusted: Any) -> None:
    with pytest.raises(ConfigError, match="trusted_types") as caught:
        ddpkit.load_checkpoint(tmp_path, {}, trusted_types=trusted)
    assert caught.value.hint


# --- what ddpkit stores loads under weights_only -----------------------------------------------


def test_everything_ddpkit_stores_loads_bitwise(tmp_path: Path) -> None:
    ddpkit.init(env={})
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        data = torch.utils.data.TensorDataset(torch.arange(20.0))
        train = ddpkit.loader(data, 2, shuffle=True, seed=1)
        next(iter(train))
        state = {"model": model, "optimizer": optimizer, "train": train, "step": 7}
        random.seed(4)
        numpy.random.seed(5)
        ddpkit.save_checkpoint(tmp_path, state, step=7)
        draws = [random.random(), numpy.random.rand(3).tolist(), torch.rand(2).tolist()]
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        restored = {
            "model": fresh,
            "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.1),
            "train": ddpkit.loader(data, 2, shuffle=True, seed=1),
        }
        assert ddpkit.load_checkpoint(tmp_path, restored) == 7
        assert [random.random(), numpy.random.rand(3).tolist(), torch.rand(2).tolist()] == draws
        for mine, theirs in zip(
            fresh.state_dict().values(), model.state_dict().values(), strict=True
        ):
            assert torch.equal(mine, theirs)
        assert _same_optim(restored["optimizer"], optimizer)
        assert restored["train"].state_dict() == train.state_dict()
    finally:
        ddpkit.shutdown()


def _same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    left, right = a.state_dict(), b.state_dict()
    if left["param_groups"] != right["param_groups"]:
        return False
    return all(
        torch.equal(left["state"][key]["momentum_buffer"], right["state"][key]["momentum_buffer"])
        for key in right["state"]
    )


def test_checkpoints_written_before_weights_only_still_load(tmp_path: Path) -> None:
    """Files of ddpkit at 42ddb9c (tests/data/checkpoints/generate.py), named before the write
    order was in the name: everything comes back. Their order was inside the pickle, which
    nothing reads but the load: among themselves they go by step (step 100 was written after
    step 500, so a load of the folder takes 500 now), and any later save is newer."""
    from ddpkit.worker import ckptfiles

    folder = tmp_path / "legacy"
    shutil.copytree(LEGACY, folder)
    expected = json.loads((folder / "expected.json").read_text())
    assert [(entry.step, entry.sequence) for entry in ckptfiles.written(folder)] == [
        (100, 0),
        (500, 0),
    ]
    ddpkit.init(env={})
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        data = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(20, 2))
        state: dict[str, Any] = {
            "model": model,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.1),
            "train": ddpkit.loader(data, 4, shuffle=True, seed=3),
        }
        assert ddpkit.load_checkpoint(folder / "ckpt-000000100.pt", state) == expected["step"]
        assert expected["step"] == 100
        weights = [torch.tensor(value) for value in expected["weights"]]
        for mine, theirs in zip(model.state_dict().values(), weights, strict=True):
            assert torch.equal(mine, theirs)
        assert state["optimizer"].state_dict()["param_groups"][0]["lr"] == 0.1
        # a loader state saved before "start" existed reads as the start of the epoch
        assert state["train"].state_dict() == {"start": 0, **expected["train"]}
        assert state["note"] == "legacy" and torch.equal(state["loss"], torch.tensor([1.5, 8.0]))
        draws = [random.random(), numpy.random.rand(2).tolist(), torch.rand(3).tolist()]
        assert draws == expected["draws"]
    finally:
        ddpkit.shutdown()
    assert ddpkit.load_checkpoint(folder, {}) == 500  # the highest step of the old names
    # a new save is newer than both and prunes the legacy files oldest first
    with pytest.warns(RuntimeWarning, match=r"higher steps \[500\]"):  # step 500: older
        ddpkit.save_checkpoint(folder, {"x": 1}, step=101, keep_last=2)
    assert [path.name for path in checkpoint_files(folder)] == [
        "ckpt-000000500.pt",
        "ckpt-000000101-000000001.pt",
    ]
    assert ddpkit.load_checkpoint(folder, {}) == 101


# --- every rank refuses alike ------------------------------------------------------------------


def _refusing_worker(rank: int, world_size: int, port: int, root: str) -> dict[str, Any]:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    try:
        folder, marker = Path(root) / "ckpt", Path(root) / "marker"
        ddpkit.save_checkpoint(folder, {"w": torch.ones(2)}, step=1)
        if rank == 0:
            _plant(folder / planted_name("forged"), "forged-system", marker)
        torch.distributed.barrier()
        start = time.monotonic()
        try:
            ddpkit.load_checkpoint(folder, {})
        except CheckpointError as error:
            return {"message": error.message, "seconds": time.monotonic() - start}
        return {"message": None}
    finally:
        ddpkit.shutdown()


@pytest.mark.multiproc
def test_every_rank_refuses_a_planted_newest_file(tmp_path: Path) -> None:
    results = run_workers(_refusing_worker, 2, str(tmp_path), timeout_s=60)
    for result in results:
        assert result["message"] is not None and "holds posix.system" in result["message"]
        assert result["message"].startswith("ranks 0, 1 could not read the checkpoints in ")
        assert result["seconds"] < 20, result
    assert not (tmp_path / "marker").exists()
