"""One state-dict format across single, dp, ddp and compiled models, on CPU.

Compiled models are real ``torch.compile(..., backend="eager")`` wrappers: the same
``OptimizedModule`` and ``_orig_mod.`` keys as any backend, without code generation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from tests.support.distutil import run_workers, torchrun_env


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _compiled(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="eager")  # type: ignore[return-value]


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


MODES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "single": lambda model: model,
    "dp": nn.DataParallel,
    "ddp": nn.parallel.DistributedDataParallel,
    "compiled": _compiled,
    "ddp-compiled": lambda model: _compiled(nn.parallel.DistributedDataParallel(model)),
    "compiled-ddp": lambda model: nn.parallel.DistributedDataParallel(_compiled(model)),
}


def _equal(first: nn.Module, second: nn.Module) -> bool:
    left = ddpkit.clean_state_dict(first.state_dict())
    right = ddpkit.clean_state_dict(second.state_dict())
    return list(left) == list(right) and all(torch.equal(left[k], right[k]) for k in left)


@pytest.mark.usefixtures("world_of_one")
def test_every_mode_loads_every_other() -> None:
    for source_mode, make_source in MODES.items():
        source = make_source(_net(1))
        saved = source.state_dict()
        for target_mode, make_target in MODES.items():
            target = make_target(_net(2))
            assert not _equal(source, target)
            ddpkit.load_state_dict(target, saved)
            assert _equal(source, target), (source_mode, target_mode)
    for mode in ("dp", "ddp", "compiled"):  # plain torch: unexpected / missing keys
        with pytest.raises(RuntimeError, match="Missing key"):
            _net(2).load_state_dict(MODES[mode](_net(1)).state_dict())


def test_clean_state_dict_prefixes_and_metadata() -> None:
    model = _net(0)
    wrapped = _compiled(nn.DataParallel(model))
    raw = wrapped.state_dict()
    assert next(iter(raw)).startswith("_orig_mod.module.")
    cleaned = ddpkit.clean_state_dict(raw)
    assert list(cleaned) == list(model.state_dict())
    assert cleaned._metadata["1"] == model.state_dict()._metadata["1"]  # type: ignore[attr-defined]
    assert ddpkit.unwrap(wrapped) is model


def test_a_compiled_submodule_and_a_child_named_module_load_exactly() -> None:
    class Holder(nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.module = _net(seed)  # a user's child that happens to be called "module"

    class Partly(nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.encoder = _compiled(_net(seed))  # keys: encoder._orig_mod.0.weight ...

    for make in (Holder, Partly):
        source, target = make(1), make(2)
        ddpkit.load_state_dict(target, nn.DataParallel(source).state_dict())
        assert _equal(source, target), make.__name__
        ddpkit.load_state_dict(target, ddpkit.clean_state_dict(_net(3).state_dict()), strict=False)


def test_keys_that_collide_without_prefixes_are_an_error() -> None:
    state = OrderedDict([("module.w", torch.zeros(1)), ("_orig_mod.module.w", torch.ones(1))])
    with pytest.raises(
        ConfigError, match=r"'module\.w' and '_orig_mod\.module\.w' both become 'w'"
    ):
        ddpkit.clean_state_dict(state)


def _save_under_ddp(rank: int, world_size: int, port: int, folder: str) -> None:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    model = ddpkit.wrap(_net(5))
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    ddpkit.save_checkpoint(folder, {"model": model}, step=3)
    torch.save(model.state_dict(), Path(folder) / f"plain-{rank}.pt")  # with "module." keys
    ddpkit.shutdown()


@pytest.mark.multiproc
def test_a_two_process_ddp_checkpoint_loads_into_plain_and_compiled_models(tmp_path: Path) -> None:
    run_workers(_save_under_ddp, 2, str(tmp_path))
    reference = _net(5)
    for target in (_net(9), _compiled(_net(9))):
        with pytest.warns(RuntimeWarning, match="saved by 2 ranks, this job has 1"):
            assert ddpkit.load_checkpoint(tmp_path, {"model": target}) == 3
        assert _equal(reference, target)
    plain: dict[str, Any] = torch.load(tmp_path / "plain-0.pt", weights_only=True)
    assert next(iter(plain)).startswith("module.")
    target = _compiled(_net(9))
    ddpkit.load_state_dict(target, plain)
    assert _equal(reference, target)


def test_a_compiled_model_s_checkpoint_has_bare_keys(tmp_path: Path) -> None:
    source = _compiled(_net(4))
    ddpkit.save_checkpoint(tmp_path, {"model": source}, step=1)
    (path,) = tmp_path.glob("ckpt-000000001-*.pt")
    payload = torch.load(path, weights_only=False)
    assert list(payload["state"]["model"]) == list(_net(0).state_dict())
    target = nn.DataParallel(_net(8))
    assert ddpkit.load_checkpoint(tmp_path, {"model": target}) == 1
    assert _equal(source, target)
