"""ddpkit.reduce and ddpkit.Mean on real gloo groups of 1, 2 and 3 ranks.

The epoch's mean is checked where the sampler pads: 7 and 11 samples in batches of 2 leave one
or two padded duplicates at 2 and 3 ranks, and the per-sample value is the sample's index, so
the exact mean is known (and the naive mean of per-rank means, TRL #7010's, is not it).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.errors import ConfigError, UsageError
from tests.support.distutil import Indices, run_workers, torchrun_env


def _reduce_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    value = rank + 1  # ranks hold 1, 2, 3
    seen: dict[str, Any] = {
        "sum_int": ddpkit.reduce(value, "sum"),
        "max_int": ddpkit.reduce(value, "max"),
        "mean_int": ddpkit.reduce(value),
        "mean_float": ddpkit.reduce(float(value), "mean"),
        # rank r's value stands for r + 1 samples: sum((r+1)^2) / sum(r+1)
        "weighted": ddpkit.reduce(float(value), weight=value),
        "zero_weights": ddpkit.reduce(1.0, weight=0),
    }
    tensor = torch.full((2, 3), float(value), dtype=torch.float32)
    # tensors come back as lists (a tensor through the result queue outlives its worker badly)
    mean = ddpkit.reduce(tensor)
    seen["tensor_mean"] = (mean.tolist(), str(mean.dtype))
    seen["tensor_untouched"] = tensor.tolist()  # the caller's tensor is not reduced in place
    seen["tensor_sum"] = ddpkit.reduce(tensor, "sum").tolist()
    top = ddpkit.reduce(torch.tensor([value, -value]), "max")
    seen["tensor_max_int"] = (top.tolist(), str(top.dtype))
    seen["epochs"] = {size: _epoch_means(size) for size in (7, 11)}
    dist.barrier()
    ddpkit.shutdown()
    return seen


def _epoch_means(size: int) -> dict[str, Any]:
    """One epoch over Indices(size): the exact mean, and the naive mean of per-rank means."""
    exact, weighted = ddpkit.Mean(), ddpkit.Mean()
    local: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for indices in ddpkit.loader(Indices(size), 2, shuffle=False):
            values = indices.double()
            exact.update(values)  # one value per sample: the padded rows are left out
            weighted.update(float(values.mean()), weight=len(values))  # a batch mean
            local += values.tolist()
    return {
        "exact": exact.compute(),
        "weighted": weighted.compute(),
        "naive": ddpkit.reduce(sum(local) / len(local)),  # the mean of per-rank means
        "warned": [str(w.message) for w in caught],
    }


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_reduce_and_an_epochs_exact_mean(world_size: int) -> None:
    values = list(range(1, world_size + 1))
    for rank, seen in enumerate(run_workers(_reduce_worker, world_size)):
        assert seen["sum_int"] == sum(values) and isinstance(seen["sum_int"], int)
        assert seen["max_int"] == world_size and isinstance(seen["max_int"], int)
        assert seen["mean_int"] == pytest.approx(sum(values) / world_size)
        assert isinstance(seen["mean_int"], float)
        assert seen["mean_float"] == pytest.approx(sum(values) / world_size)
        assert seen["weighted"] == pytest.approx(sum(v * v for v in values) / sum(values))
        assert seen["zero_weights"] != seen["zero_weights"]  # NaN: no sample anywhere
        mean, total = sum(values) / world_size, float(sum(values))
        assert seen["tensor_mean"][1] == "torch.float32"
        assert seen["tensor_mean"][0] == [pytest.approx([mean] * 3)] * 2
        assert seen["tensor_sum"] == [[total] * 3] * 2
        assert seen["tensor_untouched"] == [[float(rank + 1)] * 3] * 2
        assert seen["tensor_max_int"] == ([world_size, -1], "torch.int64")
        for size, means in seen["epochs"].items():
            assert means["exact"] == pytest.approx((size - 1) / 2)  # the mean of 0..size-1
            padded = -(-size // world_size) * world_size > size
            if padded:  # the pitfall: the duplicates count in the naive and the batch mean
                assert means["naive"] != pytest.approx((size - 1) / 2)
                assert means["weighted"] != pytest.approx((size - 1) / 2)
            else:
                assert means["naive"] == pytest.approx((size - 1) / 2)
            warned = [w for w in means["warned"] if "padded duplicates" in w]
            holds_padding = -(-(size - rank) // world_size) < -(-size // world_size)
            assert len(warned) == int(holds_padding), means["warned"]  # once, where it counts


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


def test_trl_7010_example(world_of_one: ddpkit.Context) -> None:
    """The module doc's figures: losses [10, 0, 0, 0, 0] on 2 ranks, one of them padded."""
    losses = [10.0, 0.0, 0.0, 0.0, 0.0]
    shards = [[losses[0], losses[2], losses[4]], [losses[1], losses[3], losses[0]]]
    naive = sum(sum(shard) / len(shard) for shard in shards) / 2
    assert round(naive, 2) == 3.33
    mean = ddpkit.Mean()
    mean.update(losses)
    assert mean.compute() == 2.0
    mean.reset()
    assert mean.compute() != mean.compute()  # NaN: nothing added


def test_mean_checks_the_rows_of_a_loader_step(world_of_one: ddpkit.Context) -> None:
    mean = ddpkit.Mean()
    for _ in ddpkit.loader(Indices(5), 2):
        with pytest.raises(ConfigError, match="got 3 values for step 0") as caught:
            mean.update(torch.zeros(3))
        assert caught.value.hint is not None and "reduction='none'" in caught.value.hint
        with pytest.raises(ConfigError, match="a single number without weight="):
            mean.update(torch.tensor(1.0))
        with pytest.raises(ConfigError, match=r"Mean\.update\(weight=-2\) must be a number"):
            mean.update(1.0, weight=-2)
        break


@pytest.mark.parametrize(
    ("value", "op", "weight", "message"),
    [
        (1.0, "avg", None, "reduce(op='avg') is not a known reduction"),
        ("1", "sum", None, "reduce(value) got str"),
        (True, "sum", None, "reduce(value) got bool"),
        (torch.tensor([1, 2]), "mean", None, "got a torch.int64 tensor"),
        (1.0, "sum", 2, "a weight only applies to op='mean'"),
        (1.0, "mean", -1, "reduce(weight=-1) must be a number >= 0"),
    ],
)
def test_bad_reduce_arguments(
    world_of_one: ddpkit.Context, value: Any, op: Any, weight: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        ddpkit.reduce(value, op, weight=weight)
    assert message in str(caught.value)


def test_reduce_before_init() -> None:
    with pytest.raises(UsageError, match="init"):
        ddpkit.reduce(1.0)
