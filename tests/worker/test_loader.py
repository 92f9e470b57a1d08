"""ddpkit.loader: shards, automatic epochs, resuming; world 1 in-process, 2 and 3 spawned."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

import ddpkit
from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker.loader import ShardLayout
from tests.support.distutil import Indices, run_workers, torchrun_env


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def _epoch(loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch]


def _permutation(size: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed + epoch)  # DistributedSampler's recipe
    return torch.randperm(size, generator=generator).tolist()


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


# --- layout arithmetic (pure) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "steps", "rows", "real"),
    [
        # 7 samples, 2 ranks, batch 2: 4 per rank (one padding position, 7), steps of 2 + 2
        (ShardLayout(7, 2, 4, 2, False), 2, [2, 2], [4, 3]),
        # 10 samples, 3 ranks, batch 3: 4 per rank (positions 10, 11 padding), steps 3 + 1
        (ShardLayout(10, 3, 4, 3, False), 2, [3, 1], [9, 1]),
        (ShardLayout(10, 3, 4, 3, True), 1, [3], [9]),  # the partial last batch dropped
        (ShardLayout(11, 1, 11, 4, False), 3, [4, 4, 3], [4, 4, 3]),
        (ShardLayout(1, 3, 1, 4, False), 1, [1], [1]),  # fewer samples than ranks
        (ShardLayout(12, 3, 4, 4, False), 1, [4], [12]),
    ],
)
def test_shard_layout(layout: ShardLayout, steps: int, rows: list[int], real: list[int]) -> None:
    assert layout.steps == steps
    assert [layout.rows(s) for s in range(steps)] == rows
    assert [layout.real_rows(s) for s in range(steps)] == real
    assert layout.rows(steps) == 0 and layout.real_rows(steps) == 0


# --- world size 1, in this process -------------------------------------------------------------


def test_loader_before_init_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        ddpkit.loader(Indices(4), 2)


def test_world_of_one_covers_everything_and_reshuffles(world_of_one: ddpkit.Context) -> None:
    loader = ddpkit.loader(Indices(10), 3, seed=5)
    assert loader.epoch == 0 and len(loader) == 4
    passes = [_epoch(loader) for _ in range(3)]
    assert loader.epoch == 2
    for epoch, order in enumerate(passes):
        assert order == _permutation(10, 5, epoch)
    assert len({tuple(order) for order in passes}) == 3


def test_set_epoch_and_epoch_argument_resume(world_of_one: ddpkit.Context) -> None:
    first = ddpkit.loader(Indices(9), 4, seed=1)
    orders = [_epoch(first) for _ in range(3)]
    first.set_epoch(1)
    assert first.epoch == 2  # set_epoch names the *next* pass
    assert _epoch(first) == orders[1] and first.epoch == 1
    assert _epoch(first) == orders[2]  # and counting goes on from there
    resumed = ddpkit.loader(Indices(9), 4, seed=1, epoch=2)
    assert resumed.epoch == 2 and _epoch(resumed) == orders[2]
    classic = ddpkit.loader(Indices(9), 4, seed=1)
    for epoch in (0, 1):  # the usual `sampler.set_epoch(epoch)` idiom gives the same orders
        classic.sampler.set_epoch(epoch)  # type: ignore[union-attr]
        assert _epoch(classic) == orders[epoch]


def test_shuffle_false_and_drop_last(world_of_one: ddpkit.Context) -> None:
    assert _epoch(ddpkit.loader(Indices(7), 3, shuffle=False)) == list(range(7))
    dropped = ddpkit.loader(Indices(7), 3, shuffle=False, drop_last=True)
    assert len(dropped) == 2 and _epoch(dropped) == list(range(6))


def test_dataloader_options_pass_through(world_of_one: ddpkit.Context) -> None:
    loader = ddpkit.loader(Indices(5), 2, shuffle=False, collate_fn=lambda rows: rows)
    assert list(loader) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize(
    ("dataset", "batch_size", "kwargs", "match"),
    [
        (Indices(4), 2, {"sampler": [0, 1]}, "sampler="),
        (Indices(4), 2, {"batch_sampler": [[0]]}, "batch_sampler="),
        (Stream(), 2, {}, "IterableDataset"),
        (Indices(4), 0, {}, "batch_size=0"),
        (Indices(4), 2, {"epoch": -1}, "epoch=-1"),
    ],
)
def test_loader_rejects(
    world_of_one: ddpkit.Context, dataset: Any, batch_size: int, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        ddpkit.loader(dataset, batch_size, **kwargs)
    assert caught.value.hint


# --- world sizes 2 and 3, spawned ------------------------------------------------------------


def _loader_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    ctx = ddpkit.init(env=torchrun_env(rank, world_size, port))
    seen: dict[str, Any] = {}
    for size in (9, 10, 11):
        loader = ddpkit.loader(Indices(size), 2, seed=3)
        seen[f"shuffled-{size}"] = [_epoch(loader) for _ in range(3)]
        seen[f"resumed-{size}"] = _epoch(ddpkit.loader(Indices(size), 2, seed=3, epoch=2))
        seen[f"ordered-{size}"] = _epoch(ddpkit.loader(Indices(size), 2, shuffle=False))
        dropped = ddpkit.loader(Indices(size), 2, shuffle=False, drop_last=True)
        seen[f"dropped-{size}"] = _epoch(dropped)
    seen["rank"] = ctx.rank
    dist.barrier()  # nobody tears down while a peer still works
    ddpkit.shutdown()
    return seen


def _interleave(shards: list[list[int]]) -> list[int]:
    """Back to sampler position order: rank r's j-th sample is position j * W + r."""
    return [shard[j] for j in range(len(shards[0])) for shard in shards]


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 3])
def test_shards_in_a_real_group(world_size: int) -> None:
    results = run_workers(_loader_worker, world_size)
    assert [seen["rank"] for seen in results] == list(range(world_size))
    for size in (9, 10, 11):
        padded = -(-size // world_size) * world_size
        for epoch in range(3):
            shards = [seen[f"shuffled-{size}"][epoch] for seen in results]
            assert {len(shard) for shard in shards} == {padded // world_size}
            # Every rank used the same permutation: interleaved back, it is that epoch's one.
            positions = _interleave(shards)
            assert positions[:size] == _permutation(size, 3, epoch)
            assert positions[size:] == positions[: padded - size]  # padding repeats the head
            counts = Counter(positions)
            assert set(counts) == set(range(size)) and sum(counts.values()) == padded
        epochs = [
            tuple(_interleave([seen[f"shuffled-{size}"][e] for seen in results])) for e in range(3)
        ]
        assert len(set(epochs)) == 3  # a new shuffle every epoch, without set_epoch
        for seen in results:
            assert seen[f"resumed-{size}"] == seen[f"shuffled-{size}"][2]
        ordered = _interleave([seen[f"ordered-{size}"] for seen in results])
        assert ordered[:size] == list(range(size))
        dropped = [seen[f"dropped-{size}"] for seen in results]
        kept = (size // world_size) // 2 * 2  # per rank: tail of the dataset, then partial batch
        assert all(len(shard) == kept for shard in dropped)
        assert sorted(_interleave(dropped)) == list(range(kept * world_size))
        if size % world_size == 0:  # divisible: disjoint shards, no padding
            assert len(set().union(*map(set, shards))) == size
