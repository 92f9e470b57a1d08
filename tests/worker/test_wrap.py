"""ddpkit.wrap: the strategy table, world size 1 in-process, real DDP over gloo at world 2."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker.wrap import resolve_strategy
from tests.support.distutil import run_workers, torchrun_env


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


@pytest.mark.parametrize(
    ("strategy", "world_size", "device_type", "count", "expected"),
    [
        ("auto", 1, "cpu", 0, "single"),
        ("auto", 2, "cpu", 0, "ddp"),
        ("auto", 4, "cuda", 1, "ddp"),
        ("auto", 4, "cuda", 8, "ddp"),
        ("auto", 1, "cuda", 1, "single"),
        ("auto", 1, "cuda", 4, "dp"),
        ("ddp", 1, "cpu", 0, "ddp"),
        ("dp", 1, "cuda", 2, "dp"),
        ("single", 8, "cuda", 8, "single"),
    ],
)
def test_resolve_strategy(
    strategy: str, world_size: int, device_type: str, count: int, expected: str
) -> None:
    got = resolve_strategy(
        strategy, world_size=world_size, device_type=device_type, device_count=count
    )
    assert got == expected


@pytest.mark.parametrize(
    ("strategy", "fragment"),
    [
        ("DDP", "did you mean 'ddp'?"),
        ("singel", "did you mean 'single'?"),
        ("autoo", "did you mean 'auto'?"),
        ("fsdpp", "did you mean 'fsdp'?"),
        ("zero3", "'auto', 'ddp', 'dp', 'fsdp', 'single'"),
    ],
)
def test_bad_strategy_names_it_and_suggests(strategy: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_strategy(strategy, world_size=1, device_type="cpu", device_count=0)
    assert f"strategy={strategy!r}" in str(caught.value)
    assert caught.value.hint is not None and fragment in caught.value.hint


def test_dataparallel_across_processes_is_refused() -> None:
    with pytest.raises(ConfigError, match="strategy='dp' with world_size=2"):
        resolve_strategy("dp", world_size=2, device_type="cuda", device_count=2)


def test_wrap_before_init_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="init"):
        ddpkit.wrap(nn.Linear(2, 2))


def test_world_of_one_keeps_the_plain_model(world_of_one: ddpkit.Context) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    # DDP options are accepted (so one script serves every world size) and unused here.
    wrapped = ddpkit.wrap(model, find_unused_parameters=True)
    assert wrapped is model and type(wrapped[1]) is nn.BatchNorm1d
    assert next(wrapped.parameters()).device == world_of_one.device


def test_sync_batchnorm_outside_ddp_warns_and_does_not_convert(
    world_of_one: ddpkit.Context,
) -> None:
    with pytest.warns(RuntimeWarning, match="sync_batchnorm=True ignored"):
        wrapped = ddpkit.wrap(nn.BatchNorm1d(3), sync_batchnorm=True)
    assert type(wrapped) is nn.BatchNorm1d


def test_ddp_option_typo_and_misplaced_options(world_of_one: ddpkit.Context) -> None:
    with pytest.raises(ConfigError, match="find_unused_parameter=True") as caught:
        ddpkit.wrap(nn.Linear(2, 2), find_unused_parameter=True)
    assert caught.value.hint is not None and "'find_unused_parameters'" in caught.value.hint
    with pytest.raises(ConfigError, match="strategy='single'"):
        ddpkit.wrap(nn.Linear(2, 2), "single", static_graph=True)
    with pytest.raises(ConfigError, match="did you mean 'ddp'"):
        ddpkit.wrap(nn.Linear(2, 2), "ddpp")


def test_explicit_ddp_at_world_one(world_of_one: ddpkit.Context) -> None:
    wrapped = ddpkit.wrap(nn.Linear(2, 2), "ddp")
    assert isinstance(wrapped, DistributedDataParallel)
    with pytest.raises(ConfigError, match="already wrapped in DistributedDataParallel"):
        ddpkit.wrap(wrapped)


def _ddp_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    wrapped = ddpkit.wrap(model)
    seen: dict[str, Any] = {"type": type(wrapped).__name__}
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    inputs, targets = torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator)
    nn.functional.mse_loss(wrapped(inputs), targets).backward()
    grads = [p.grad.clone() for p in wrapped.parameters() if p.grad is not None]
    # What DDP must produce: the average over ranks of each rank's own gradient.
    nn.functional.mse_loss(reference(inputs), targets).backward()
    expected = [p.grad.clone() for p in reference.parameters() if p.grad is not None]
    for grad in expected:
        dist.all_reduce(grad)
        grad /= world_size
    seen["grads_match_average"] = len(grads) == len(expected) and all(
        torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, expected, strict=True)
    )
    seen["grads"] = [g.tolist() for g in grads]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        synced = ddpkit.wrap(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), sync_batchnorm=True)
    seen["sync_types"] = [type(m).__name__ for m in synced.module]
    seen["sync_cpu_warning"] = any("ignored on cpu" in str(w.message) for w in caught)
    seen["sync_train_shape"] = tuple(synced(torch.randn(5, 3)).shape)
    dist.barrier()
    ddpkit.shutdown()
    return seen


@pytest.mark.multiproc
def test_ddp_at_world_two_averages_gradients() -> None:
    first, second = run_workers(_ddp_worker, 2)
    for seen in (first, second):
        assert seen["type"] == "DistributedDataParallel"
        assert seen["grads_match_average"]
        # On CPU DDP refuses SyncBatchNorm: wrap keeps BatchNorm and says so (the GPU
        # conversion path cannot run on this CPU-only machine).
        assert seen["sync_types"] == ["Linear", "BatchNorm1d"]
        assert seen["sync_cpu_warning"]
        assert seen["sync_train_shape"] == (5, 3)
    assert first["grads"] == second["grads"]  # bit-identical after the all-reduce
