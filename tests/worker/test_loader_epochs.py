"""When a ddpkit.loader pass counts as an epoch: peeks and empty passes do not, full ones do.

The rule (module doc of ddpkit.worker.loader): a pass counts once it yields its second batch or
runs to its end; the next pass then uses the next epoch. A pass abandoned before its second
batch (``next(iter(loader))``, an ``iter()`` never consumed, a ``break`` after one batch) leaves
the next pass where it started: same epoch, same resume position.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import ddpkit
from tests.support.distutil import Indices, run_workers, torchrun_env


def _ids(batches: Any) -> list[int]:
    return [int(i) for batch in batches for i in batch]


def _permutation(size: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed + epoch)  # DistributedSampler's recipe
    return torch.randperm(size, generator=generator).tolist()


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_peek_each_epoch_does_not_advance_the_epoch(
    world_of_one: ddpkit.Context, num_workers: int
) -> None:
    loader = ddpkit.loader(Indices(10), 3, seed=5, num_workers=num_workers)
    for epoch in range(3):
        peeked = next(iter(loader))
        assert loader.epoch == epoch
        assert len(loader) == 4  # the epoch's batches, as before the peek
        order = _ids(loader)
        assert loader.epoch == epoch
        assert order == _permutation(10, 5, epoch)  # one epoch number for the peek and pass
        assert peeked.tolist() == order[:3]  # the peeked batch is the epoch's first


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iter_without_consuming_does_not_advance(
    world_of_one: ddpkit.Context, num_workers: int
) -> None:
    loader = ddpkit.loader(Indices(10), 3, seed=5, num_workers=num_workers)
    iter(loader)  # with worker processes this already draws indices (prefetch)
    iter(loader)
    assert loader.state_dict()["epoch"] == 0
    assert _ids(loader) == _permutation(10, 5, 0)
    assert _ids(loader) == _permutation(10, 5, 1)  # full passes still reshuffle


@pytest.mark.parametrize(("k", "next_epoch"), [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_a_pass_left_after_k_batches(world_of_one: ddpkit.Context, k: int, next_epoch: int) -> None:
    """Before its second batch a pass is a peek; from it on, the next pass is a new epoch."""
    loader = ddpkit.loader(Indices(10), 3, seed=5)
    if k:
        for done, _ in enumerate(loader, start=1):
            if done == k:
                break
        assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (0, k)
    assert _ids(loader) == _permutation(10, 5, next_epoch)
    assert loader.epoch == next_epoch
    assert loader.state_dict()["epoch"] == next_epoch + 1


def test_a_one_batch_epoch_still_counts_when_it_ends(world_of_one: ddpkit.Context) -> None:
    loader = ddpkit.loader(Indices(4), 8, seed=5)  # the whole epoch is one batch
    passes = [_ids(loader) for _ in range(3)]
    assert passes == [_permutation(4, 5, epoch) for epoch in range(3)]


def test_an_older_iterator_moves_nothing(world_of_one: ddpkit.Context) -> None:
    """Only the latest pass counts: finishing an iterator peeked at earlier changes no epoch."""
    loader = ddpkit.loader(Indices(10), 3, seed=5)
    early = iter(loader)
    next(early)
    assert _ids(loader) == _permutation(10, 5, 0)
    later = iter(loader)
    assert _ids(early) == _permutation(10, 5, 0)[3:]  # the rest of the old pass
    assert loader.epoch == 1 and len(loader) == 4
    assert _ids(later) == _permutation(10, 5, 1)
    assert loader.state_dict()["epoch"] == 2


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_peek_with_the_set_epoch_idiom(world_of_one: ddpkit.Context, when: str) -> None:
    """``sampler.set_epoch(epoch)`` before or after the peek (pytorch/examples has both)."""
    loader = ddpkit.loader(Indices(9), 2, seed=1)
    for epoch in (0, 1, 2, 7):
        if when == "before":
            loader.sampler.set_epoch(epoch)  # type: ignore[union-attr]
        peeked = next(iter(loader))
        if when == "after":
            loader.sampler.set_epoch(epoch)  # type: ignore[union-attr]
        order = _ids(loader)
        assert order == _permutation(9, 1, epoch) and loader.epoch == epoch
        assert when == "after" or peeked.tolist() == order[:2]


def test_a_peek_on_a_resumed_loader_keeps_its_position(world_of_one: ddpkit.Context) -> None:
    reference = ddpkit.loader(Indices(11), 2, seed=3)
    epochs = [[b.tolist() for b in reference] for _ in range(2)]
    first = ddpkit.loader(Indices(11), 2, seed=3)
    for done, _ in enumerate(first, start=1):
        if done == 2:
            break
    resumed = ddpkit.loader(Indices(11), 2, seed=3)
    resumed.load_state_dict(first.state_dict())
    peeked = next(iter(resumed))
    assert peeked.tolist() == epochs[0][2] and len(resumed) == len(epochs[0]) - 2
    assert [b.tolist() for b in resumed] == epochs[0][2:]
    assert [b.tolist() for b in resumed] == epochs[1]


def test_progress_after_a_peek(world_of_one: ddpkit.Context) -> None:
    first = ddpkit.loader(Indices(10), 2, seed=3)
    for done, _ in enumerate(first, start=1):
        if done == 2:
            break
    loader = ddpkit.loader(Indices(10), 2, seed=3)
    loader.load_state_dict(first.state_dict())
    for start in (2, 0):  # the resumed pass, then a whole one
        next(iter(loader))
        bar = ddpkit.progress(loader, enabled=False, file=io.StringIO())
        positions = [(bar.n, bar.total) for _ in bar]
        assert positions == [(n, 5) for n in range(start, 5)]


class _Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(features, target) rows; feature 0 is the sample id."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(index), 1.0]), torch.tensor([float(index % 2)])


class _Trainer:
    """The pytorch/examples DDP-tutorial ``Trainer`` loop: each epoch peeks for the batch size."""

    def __init__(self, train_data: Any) -> None:
        self.train_data = train_data
        self.log = io.StringIO()
        self.seen: list[list[int]] = []

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(f"Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}", file=self.log)
        self.seen.append([])
        for source, _targets in self.train_data:
            self.seen[-1] += [int(row[0]) for row in source]

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def test_the_pytorch_examples_trainer(world_of_one: ddpkit.Context) -> None:
    trainer = _Trainer(ddpkit.loader(_Pairs(), 5, seed=2))
    trainer.train(3)
    assert trainer.seen == [_permutation(24, 2, epoch) for epoch in range(3)]
    assert trainer.log.getvalue().splitlines() == [
        f"Epoch {epoch} | Batchsize: 5 | Steps: 5" for epoch in range(3)
    ]


# --- world size 2, spawned ---------------------------------------------------------------------


def _peek_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    try:
        plain = ddpkit.loader(Indices(11), 2, seed=4)
        without = [_ids(plain) for _ in range(3)]
        peeking = ddpkit.loader(Indices(11), 2, seed=4)
        with_peek, peeks, gathered, epochs = [], [], [], []
        for _ in range(3):
            peeks.append(next(iter(peeking)).tolist())
            epochs.append(peeking.epoch)
            with_peek.append([])
            for batch in peeking:
                with_peek[-1] += batch.tolist()
                gathered += ddpkit.gather(batch).tolist()
        trainer = _Trainer(ddpkit.loader(_Pairs(), 5, seed=2))
        trainer.train(3)
        dist.barrier()  # nobody tears down while a peer still works
        return {
            "without": without,
            "with_peek": with_peek,
            "peeks": peeks,
            "epochs": epochs,
            "gathered": gathered,
            "trainer": trainer.seen,
        }
    finally:
        ddpkit.shutdown()


def _interleave(shards: list[list[int]]) -> list[int]:
    """Back to sampler position order: rank r's j-th sample is position j * W + r."""
    return [shard[j] for j in range(len(shards[0])) for shard in shards]


@pytest.mark.multiproc
def test_each_rank_peeks_each_epoch_in_a_real_group() -> None:
    results = run_workers(_peek_worker, 2)
    for rank, seen in enumerate(results):
        assert seen["with_peek"] == seen["without"], rank  # the same shuffles as without peeks
        assert seen["epochs"] == [0, 1, 2], rank
        assert [order[:2] for order in seen["with_peek"]] == seen["peeks"], rank
        # gather after a peek: each epoch's 11 samples exactly once, padding cut
        for epoch in range(3):
            assert sorted(seen["gathered"][epoch * 11 : (epoch + 1) * 11]) == list(range(11))
    for epoch in range(3):
        positions = _interleave([seen["with_peek"][epoch] for seen in results])
        assert positions[:11] == _permutation(11, 4, epoch)
        trainer = _interleave([seen["trainer"][epoch] for seen in results])
        assert trainer == _permutation(24, 2, epoch)
