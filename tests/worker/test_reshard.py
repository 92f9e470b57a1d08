"""The remap of a loader's position to another world size or batch size (ddpkit.worker.reshard).

The layout is checked against torch's own ``DistributedSampler``; the remap by running the
real ``DistributedLoader`` of every rank of a world side by side in one process (a sampler
given ``num_replicas`` and ``rank`` needs no process group), stopping an epoch at random
points, resuming the saved states at other world and batch sizes, and counting the samples
each step keeps after ``gather``'s padding cut (``ShardLayout.real_rows``).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from torch.utils.data import DistributedSampler

from ddpkit.errors import ConfigError
from ddpkit.worker import reshard
from ddpkit.worker.loader import DistributedLoader, EpochSampler

SEED = 7


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_fresh_pass_is_torchs_distributed_sampler(shuffle: bool, drop_last: bool) -> None:
    for size in range(1, 24):
        for world in range(1, 6):
            if drop_last and size < world:
                continue  # torch gives every rank nothing; reshard too (checked below)
            for epoch in (0, 3):
                order = reshard.epoch_order(size, shuffle=shuffle, seed=SEED, epoch=epoch)
                for rank in range(world):
                    torch_sampler = DistributedSampler(
                        range(size),  # type: ignore[arg-type]
                        num_replicas=world,
                        rank=rank,
                        shuffle=shuffle,
                        seed=SEED,
                        drop_last=drop_last,
                    )
                    torch_sampler.set_epoch(epoch)
                    where = (size, world, rank, epoch)
                    assert reshard.shard(order, 0, world, rank, drop_last) == list(torch_sampler), (
                        where
                    )
                    assert reshard.per_rank(size, 0, world, drop_last) == len(torch_sampler)


def test_drop_last_with_fewer_samples_than_ranks_gives_nothing() -> None:
    assert reshard.per_rank(3, 0, 4, True) == 0
    assert reshard.shard([0, 1, 2], 0, 4, 1, True) == []
    assert reshard.per_rank(10, 8, 4, True) == 0


def test_a_pass_from_a_start_pads_with_the_head_of_the_rest() -> None:
    order = list(range(10))
    shards = [reshard.shard(order, 7, 2, rank, False) for rank in range(2)]
    assert shards == [[7, 9], [8, 7]]  # 3 left over 2 ranks: position 4 repeats the rest's head
    shards = [reshard.shard(order, 9, 4, rank, False) for rank in range(4)]
    assert shards == [[9], [9], [9], [9]]  # one left: every other rank repeats it


# --- the real loaders of a world, side by side -------------------------------------------------


class World:
    """The DistributedLoader of every rank of a world, stepped in lockstep."""

    def __init__(self, size: int, world: int, batch_size: int, drop_last: bool) -> None:
        self.loaders = [
            DistributedLoader(
                range(size),  # type: ignore[arg-type]
                EpochSampler(
                    range(size),
                    num_replicas=world,
                    rank=rank,
                    shuffle=True,
                    seed=SEED,
                    drop_last=drop_last,
                ),
                batch_size=batch_size,
                drop_last=drop_last,
            )
            for rank in range(world)
        ]

    def load(self, states: list[dict[str, Any]]) -> None:
        """Load rank 0's state on every rank, as ``load_checkpoint`` does (rank 0 saves it)."""
        assert all(state == states[0] for state in states)  # the position is the same everywhere
        for loader in self.loaders:
            loader.load_state_dict(states[0])

    def run(self, steps: int | None) -> tuple[list[int], list[list[int]]]:
        """Up to ``steps`` lockstep batches of the current pass (all: None): the samples every
        step keeps after gather's padding cut, in position order, and each rank's raw rows."""
        iterators = [iter(loader) for loader in self.loaders]
        kept: list[int] = []
        raw: list[list[int]] = [[] for _ in self.loaders]
        taken = 0
        while steps is None or taken < steps:
            batches = [next(iterator, None) for iterator in iterators]
            if batches[0] is None:
                assert all(batch is None for batch in batches)
                break
            rows = [[int(i) for i in batch] for batch in batches]  # type: ignore[union-attr]
            for rank, mine in enumerate(rows):
                raw[rank].extend(mine)
            layout = self.loaders[0].layout
            step = iterators[0].step  # type: ignore[attr-defined]
            merged = [row[j] for j in range(len(rows[0])) for row in rows]  # position order
            kept.extend(merged[: layout.real_rows(step)])
            taken += 1
        return kept, raw

    def states(self) -> list[dict[str, Any]]:
        return [loader.state_dict() for loader in self.loaders]


def _epoch_in_pieces(
    size: int, drop_last: bool, pieces: list[tuple[int, int, int]], last: tuple[int, int]
) -> tuple[Counter[int], list[int]]:
    """Run epoch 0 as ``pieces`` of (world, batch size, steps), each resumed from the one
    before's saved states, then ``last`` (world, batch size) to the epoch's end; return the
    samples kept over the epoch and the order of the next epoch (rank 0's rows)."""
    seen: Counter[int] = Counter()
    states: list[dict[str, Any]] = []
    for world_size, batch_size, steps in [*pieces, (*last, -1)]:
        world = World(size, world_size, batch_size, drop_last)
        if states:
            world.load(states)
        # at most the whole pass without its end: a stop right after the last batch included
        kept, _ = world.run(None if steps < 0 else min(steps, len(world.loaders[0])))
        seen.update(kept)
        states = world.states()
    assert states[0]["epoch"] == 1 and states[0]["batches"] == 0, states[0]
    _, raw = world.run(None)
    return seen, raw[0]


def _expected_next_epoch(size: int, world: int, batch_size: int, drop_last: bool) -> list[int]:
    fresh = World(size, world, batch_size, drop_last)
    fresh.run(None)
    return fresh.run(None)[1][0]


def test_every_sample_once_over_random_stops_and_world_sizes() -> None:
    rng = random.Random(20)
    cases = 0
    for size in [1, 2, 3, 5, 7, 8, 11, 16, 23, 30]:
        for drop_last in (False, True):
            for _ in range(20):
                pieces = []
                for _ in range(rng.randint(1, 3)):
                    world, batch_size = rng.randint(1, 5), rng.randint(1, 4)
                    pieces.append((world, batch_size, rng.randint(0, size // world + 1)))
                last = (rng.randint(1, 5), rng.randint(1, 4))
                seen, next_epoch = _epoch_in_pieces(size, drop_last, pieces, last)
                where = f"size={size} drop_last={drop_last} pieces={pieces} last={last}"
                assert max(seen.values(), default=1) == 1, where  # nothing twice
                assert set(seen) <= set(range(size)), where
                if not drop_last:
                    assert sorted(seen) == list(range(size)), where  # everything once
                else:  # only the last piece's tail can be left out: under one global batch
                    assert size - len(seen) < last[0] * last[1], where
                assert next_epoch == _expected_next_epoch(size, *last, drop_last), where
                cases += 1
    assert cases == 400


def test_four_to_two_to_four_mid_epoch() -> None:
    # 23 samples: at world 4, 6 per rank (one padding position); batches of 2
    seen, next_epoch = _epoch_in_pieces(23, False, [(4, 2, 1), (2, 2, 3)], (4, 2))
    assert sorted(seen) == list(range(23))
    assert next_epoch == _expected_next_epoch(23, 4, 2, False)


def test_same_world_resume_is_the_uninterrupted_pass_padding_included() -> None:
    full = World(23, 4, 2, False)
    _, expected = full.run(None)
    first = World(23, 4, 2, False)
    _, before = first.run(2)
    again = World(23, 4, 2, False)
    again.load(first.states())
    _, after = again.run(None)
    assert [b + a for b, a in zip(before, after, strict=True)] == expected


def test_a_remapped_pass_resumed_at_its_own_world_skips_its_batches() -> None:
    first = World(23, 4, 2, False)
    first.run(1)
    second = World(23, 2, 2, False)
    second.load(first.states())
    assert (second.states()[0]["start"], second.states()[0]["batches"]) == (8, 0)
    reference = World(23, 2, 2, False)
    reference.load(first.states())
    _, whole = reference.run(None)  # the rest of the epoch at world 2, uninterrupted
    second.run(2)
    assert (second.states()[0]["start"], second.states()[0]["batches"]) == (8, 2)
    third = World(23, 2, 2, False)
    third.load(second.states())
    assert third.states()[0]["start"] == 8  # same layout: the saved pass, its batches skipped
    _, rest = third.run(None)
    assert [w[4:] for w in whole] == rest
    assert len(third.loaders[0]) == len(reference.loaders[0])  # both: the next epoch, whole


def test_remap_arithmetic() -> None:
    saved = {"epoch": 2, "batches": 3, "start": 5, "world_size": 4, "batch_size": 2}
    same = reshard.remap(saved, world_size=4, batch_size=2, dataset_len=100)
    assert same == reshard.PassStart(2, 5, 3)
    assert reshard.remap(saved, world_size=2, batch_size=2, dataset_len=100) == (
        reshard.PassStart(2, 5 + 3 * 2 * 4, 0)
    )
    assert reshard.remap(saved, world_size=4, batch_size=3, dataset_len=100).start == 29
    assert reshard.remap(saved, world_size=8, batch_size=2, dataset_len=20).start == 20  # capped
    old = {"epoch": 1, "batches": 2, "world_size": 4, "batch_size": 2}  # before "start" existed
    assert reshard.remap(old, world_size=2, batch_size=2, dataset_len=100).start == 16


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"start": -1}, "start=-1"),
        ({"start": 101}, "start=101"),
        ({"start": True}, "start=True"),
        ({"batches": -1}, "batches=-1"),
        ({"world_size": 0}, "world_size=0"),
        ({"batch_size": "2"}, "batch_size='2'"),
    ],
)
def test_remap_rejects_a_bad_state(change: dict[str, Any], match: str) -> None:
    saved = {"epoch": 2, "batches": 3, "start": 5, "world_size": 4, "batch_size": 2, **change}
    with pytest.raises(ConfigError, match=match) as caught:
        reshard.remap(saved, world_size=2, batch_size=2, dataset_len=100)
    assert caught.value.hint
