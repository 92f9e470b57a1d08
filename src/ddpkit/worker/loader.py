"""Per-rank data loading whose epoch advances by itself, and the bookkeeping ``gather`` reads.

``loader()`` returns a :class:`DistributedLoader` over an :class:`EpochSampler`, a
``DistributedSampler`` whose epoch moves on after each pass that counts, so the shuffle changes
every epoch without ``set_epoch`` (pytorch#11324, #31232) and stays identical across ranks.
``set_epoch(e)`` names the epoch of the *next* pass; the standard call before each loop works.

A pass counts once it yields its second batch or runs to its end. A pass abandoned before its
second batch (``next(iter(loader))`` as a peek, an ``iter()`` never consumed) does not: the
next pass starts where it started. A ``break`` after two or more batches counts.

Each batch makes its pass the active one (:func:`active_pass`) at its step number, so
``gather`` knows how many rows each rank holds at that step and which are padding.

``state_dict()``/``load_state_dict()`` save and restore the position; a restored loader skips
the consumed batches at the sampler (their samples are never read). A state saved at another
world or batch size is remapped (:mod:`ddpkit.worker.reshard`) so every sample of the epoch is
still read once. ``len(loader)`` counts the batches of the current (or next) pass.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from ddpkit.errors import ConfigError
from ddpkit.worker import reshard
from ddpkit.worker.context import current
from ddpkit.worker.straggler import TIMES

__all__ = ["DistributedLoader", "EpochSampler", "ShardLayout", "active_pass", "loader"]


@dataclass(frozen=True)
class ShardLayout:
    """How one epoch's samples are spread over ranks and steps.

    ``DistributedSampler`` pads the index list to ``per_rank * world_size`` by repeating its
    head; rank r's j-th sample sits at position ``j * W + r``, positions ``>= dataset_len`` are
    padding. A remapped pass counts positions from its start (``dataset_len``: what it has left).
    """

    dataset_len: int
    world_size: int
    per_rank: int  # samples per rank per epoch (the sampler's num_samples)
    batch_size: int
    drop_last_batch: bool  # the DataLoader drops a final partial batch

    @property
    def steps(self) -> int:
        """Batches per rank per epoch."""
        full, rest = divmod(self.per_rank, self.batch_size)
        return full if self.drop_last_batch or rest == 0 else full + 1

    def rows(self, step: int) -> int:
        """Rows every rank holds at ``step`` (the same on all ranks)."""
        if not 0 <= step < self.steps:
            return 0
        return min(self.batch_size, self.per_rank - step * self.batch_size)

    def real_rows(self, step: int) -> int:
        """Rows of ``step`` over all ranks, in position order, that are not padding."""
        first = step * self.batch_size * self.world_size
        return max(0, min(self.rows(step) * self.world_size, self.dataset_len - first))

    def rank_real_rows(self, step: int, rank: int) -> int:
        """Rows of ``step`` on ``rank`` that are not padding: a prefix of its batch (rank r's
        row j sits at position ``(step * batch_size + j) * W + r``; padding is the tail)."""
        before = -(-(self.dataset_len - rank) // self.world_size)  # rank's real samples
        return max(0, min(self.rows(step), before - step * self.batch_size))


class EpochSampler(DistributedSampler[Any]):
    """A ``DistributedSampler`` whose passes :class:`DistributedLoader` starts and counts.

    ``epoch`` is the epoch of the pass in progress (before the first pass: the one it will
    use); ``next_epoch``/``pending_skip``/``pending_start`` say where the next pass starts:
    only a pass that counts (:meth:`count_pass`) moves them on, unless ``set_epoch(e)`` or
    :meth:`skip_next` named the next start since that pass started.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        epoch: int = 0,
    ) -> None:
        super().__init__(
            dataset,  # type: ignore[arg-type]  # torch types it Dataset; it only needs len()
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.epoch = _check_epoch(epoch)
        self.next_epoch = self.epoch
        self.pending_skip = 0  # samples of this rank's share the next pass leaves out (resume)
        self._skip = 0  # those the pass in progress leaves out
        # positions of the epoch's order left to earlier passes, by the next pass / the one in
        # progress (non-zero after a resume at another world or batch size: reshard)
        self.pending_start = 0
        self.pass_start = 0
        self._named = False  # set_epoch/skip_next named the next start since a pass started

    def set_epoch(self, epoch: int) -> None:
        self.next_epoch = _check_epoch(epoch)
        self._named = True

    def skip_next(self, samples: int, start: int = 0) -> None:
        """Make the next pass lay out its epoch's order from position ``start`` on (see
        :mod:`ddpkit.worker.reshard`) and leave out the first ``samples`` indices of this rank's
        share of it (they are never read)."""
        self.pending_skip, self.pending_start = samples, start
        self._named = True

    def samples_from(self, start: int) -> int:
        """This rank's samples in a pass that starts at position ``start`` of its epoch."""
        return reshard.per_rank(len(self.dataset), start, self.num_replicas, self.drop_last)  # type: ignore[arg-type]

    def start_pass(self) -> tuple[int, int, int]:
        """Make the next pass the one :meth:`__iter__` yields: its (epoch, start, samples left
        out). The next start stays: a pass that never counts is repeated by the next one."""
        self.epoch, self._skip = self.next_epoch, self.pending_skip
        self.pass_start = self.pending_start
        self._named = False
        return self.epoch, self.pass_start, self._skip

    def count_pass(self, epoch: int) -> None:
        """The pass of ``epoch`` counts: the next pass starts ``epoch + 1`` at its head, unless
        ``set_epoch``/``skip_next`` named another start since that pass started."""
        if not self._named:
            self.next_epoch, self.pending_skip, self.pending_start = epoch + 1, 0, 0

    def __len__(self) -> int:
        return self.samples_from(self.pass_start)

    def __iter__(self) -> Iterator[Any]:
        if self.pass_start:  # a pass resumed at another layout: the rest of the order, resharded
            order = reshard.epoch_order(
                len(self.dataset),  # type: ignore[arg-type]
                shuffle=self.shuffle,
                seed=self.seed,
                epoch=self.epoch,
            )
            mine = reshard.shard(
                order, self.pass_start, self.num_replicas, self.rank, self.drop_last
            )
            return iter(mine[self._skip :])
        indices = super().__iter__()
        # DistributedSampler builds the whole index list anyway; slicing it reads no sample.
        return iter(list(indices)[self._skip :]) if self._skip else indices


class DistributedLoader(DataLoader[Any]):
    """A ``DataLoader`` over an :class:`EpochSampler`; iterate it like any DataLoader.

    ``len(loader)`` is the number of batches of the current pass, or of the next one when none
    is in progress; a pass resumed by :meth:`load_state_dict` yields (and reports) only the
    batches left. A pass left with ``break`` stays current (``state_dict()`` saves its
    position) until the next ``iter()``.
    """

    def __init__(self, dataset: Dataset[Any], sampler: EpochSampler, **kwargs: Any) -> None:
        super().__init__(dataset, sampler=sampler, **kwargs)
        self._epoch_sampler = sampler
        # (epoch, batches yielded) of the pass in progress; None before a pass or after one
        # ended (its iterator raised StopIteration): then the position is the next pass's.
        self._position: tuple[int, int] | None = None
        self._resume_batches = 0
        self._pass_length = 0  # batches of the pass in progress (when _position is set)
        self._passes = 0  # passes started; the latest is the only one that counts

    def __len__(self) -> int:
        if self._position is not None:
            return self._pass_length
        sampler = self._epoch_sampler
        return self._remaining(
            sampler.pending_start, sampler.pending_skip // (self.batch_size or 1)
        )

    def _remaining(self, start: int, skipped: int) -> int:
        """The batches of a pass that starts at position ``start`` of its epoch and leaves out
        its first ``skipped`` batches."""
        full, rest = divmod(self._epoch_sampler.samples_from(start), self.batch_size or 1)
        whole = full if self.drop_last or rest == 0 else full + 1
        return max(0, whole - skipped)

    @property
    def epoch(self) -> int:
        """The epoch of the current pass (before the first pass: the one it will use)."""
        return self._epoch_sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use ``epoch`` (e.g. when resuming from a checkpoint)."""
        self._epoch_sampler.set_epoch(epoch)

    @property
    def layout(self) -> ShardLayout:
        sampler = self._epoch_sampler
        return ShardLayout(
            dataset_len=len(sampler.dataset) - sampler.pass_start,  # type: ignore[arg-type]
            world_size=sampler.num_replicas,
            per_rank=sampler.samples_from(sampler.pass_start),
            batch_size=self.batch_size or 1,
            drop_last_batch=self.drop_last,
        )

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch of the current pass and the batches of it already yielded (after
        a finished pass: the next epoch and 0), and ``start``, where the pass began in its
        epoch's order (0 unless a remapped resume moved it; ``batches`` count from there). A
        pass whose last batch was yielded but whose loop has not ended reports all its batches:
        a resume gives an empty pass, then the next epoch, as the loop would have.
        """
        sampler = self._epoch_sampler
        if self._position is None:
            epoch, batches, start = sampler.next_epoch, self._resume_batches, sampler.pending_start
        else:
            (epoch, batches), start = self._position, sampler.pass_start
        return {
            "epoch": epoch,
            "batches": batches,
            "start": start,
            "seed": sampler.seed,
            "world_size": sampler.num_replicas,
            "batch_size": self.batch_size or 1,
            "dataset_len": len(sampler.dataset),  # type: ignore[arg-type]
            "shuffle": sampler.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass resume at ``state``'s epoch, skipping its consumed samples unread;
        a state of another world or batch size is remapped (:mod:`ddpkit.worker.reshard`)."""
        mine = self.state_dict()
        for key, hint in _MUST_MATCH.items():
            if key in state and state[key] != mine[key]:
                raise ConfigError(
                    f"loader state {key}={state[key]!r} does not match this loader's "
                    f"{key}={mine[key]!r}",
                    hint=hint,
                )
        begin = reshard.remap(
            state,
            world_size=mine["world_size"],
            batch_size=mine["batch_size"],
            dataset_len=mine["dataset_len"],
        )
        self._epoch_sampler.set_epoch(begin.epoch)
        self._epoch_sampler.skip_next(begin.skip * mine["batch_size"], begin.start)
        self._position, self._resume_batches = None, begin.skip

    # torch annotates its private iterator class; ours wraps it and keeps its interface.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # Planned before torch builds its iterator: with worker processes, building it already
        # draws the sampler's indices (prefetch); without, the first batch does.
        epoch, start, skipped = self._epoch_sampler.start_pass()
        first = skipped // (self.batch_size or 1)
        length = self._remaining(start, first)
        inner = super().__iter__()
        self._passes += 1
        self._position, self._resume_batches = (epoch, first), 0
        self._pass_length = length
        return _TrackedIterator(self, inner, epoch, first, length=length, number=self._passes)

    def _advance(self, tracked: _TrackedIterator) -> None:
        """``tracked`` yielded a batch: its position; from its second batch on, it counts."""
        if tracked.number == self._passes:  # an older pass, still iterated, moves nothing
            self._position = (tracked.epoch, tracked.step + 1)
            if tracked.yielded >= _COUNTS_AT_BATCH:
                self._epoch_sampler.count_pass(tracked.epoch)

    def _finish(self, tracked: _TrackedIterator) -> None:
        """``tracked`` ran to its end: it counts, whatever it yielded."""
        if tracked.number == self._passes:
            self._position = None
            self._epoch_sampler.count_pass(tracked.epoch)


# A pass counts as an epoch from its second batch on: a peek (`next(iter(loader))`) takes one.
_COUNTS_AT_BATCH = 2

# world_size and batch_size may differ: the position is remapped (reshard)
_MUST_MATCH = {
    "dataset_len": "the checkpoint's position belongs to a dataset of another size; resume "
    "with the same dataset",
    "seed": "the shuffle depends on the seed; pass the checkpoint's seed to ddpkit.loader",
    "shuffle": "resume with the same shuffle= as the run that saved the checkpoint",
}


class _TrackedIterator(Iterator[Any]):
    """Counts the batches of one pass and makes itself the active pass on each one."""

    def __init__(
        self,
        owner: DistributedLoader,
        inner: Iterator[Any],
        epoch: int,
        first: int,
        *,
        length: int,
        number: int,
    ) -> None:
        self.loader = owner
        self.step = first - 1  # a resumed pass numbers its batches from where it stopped
        self.epoch = epoch
        self.number = number  # the owner's count of passes when this one started
        self.yielded = 0  # batches this pass yielded (a resumed pass's skipped ones not)
        self._inner = inner
        self._length = length

    def __iter__(self) -> _TrackedIterator:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            batch = next(self._inner)
        except StopIteration:
            TIMES.pass_ended()
            _mark(self, finished=True)
            self.loader._finish(self)
            raise
        TIMES.batch(started, time.perf_counter())
        self.step += 1
        self.yielded += 1
        self.loader._advance(self)
        _mark(self)
        return batch

    def __len__(self) -> int:
        return self._length


# The live passes by weak reference (a finished or abandoned loop, its loader and dataset are
# never kept alive), the one that yielded the latest batch last: when an inner loop (evaluation
# inside training) ends or is left with `break`, the outer loop's pass is the active one again.
_LIVE: list[weakref.ref[_TrackedIterator]] = []


def _mark(iterator: _TrackedIterator, *, finished: bool = False) -> None:
    """Put ``iterator`` on top of the live passes (it yielded a batch), or take it off."""
    if not finished and _LIVE and _LIVE[-1]() is iterator:  # every batch of a loop: no change
        return
    _LIVE[:] = [ref for ref in _LIVE if ref() is not None and ref() is not iterator]
    if not finished:
        _LIVE.append(weakref.ref(iterator))


def active_pass() -> _TrackedIterator | None:
    """The pass whose iterator yielded the latest batch (its ``loader`` and ``step``), or None."""
    while _LIVE:
        top = _LIVE[-1]()
        if top is not None:
            return top
        _LIVE.pop()  # collected: fall back to a live one
    return None


def _check_epoch(epoch: int) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ConfigError(f"epoch={epoch!r} must be a non-negative int", hint="epochs count from 0")
    return epoch


def loader(
    dataset: Dataset[Any],
    batch_size: int,
    shuffle: bool = True,
    drop_last: bool = False,
    seed: int = 0,
    *,
    epoch: int = 0,
    **dataloader_kwargs: Any,
) -> DistributedLoader:
    """A DataLoader that gives this rank its shard of ``dataset``; needs ``ddpkit.init()``.

    Every rank must pass the same ``seed`` (the shuffle is the same permutation everywhere,
    sharded by rank). ``drop_last`` applies twice, like Lightning's: the sampler drops the tail
    that does not divide evenly over ranks (instead of padding with repeated samples) and the
    DataLoader drops a final partial batch. ``epoch`` is the epoch of the first pass (resume).
    Other keyword arguments (``num_workers``, ``collate_fn``, ``pin_memory``...) go to
    ``DataLoader``; ``sampler``/``batch_sampler`` cannot, the loader owns the sampling.
    """
    context = current()
    _check_arguments(dataset, batch_size, dataloader_kwargs)
    sampler = EpochSampler(
        dataset,  # type: ignore[arg-type]  # _check_arguments verified len()
        num_replicas=context.world_size,
        rank=context.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        epoch=epoch,
    )
    return DistributedLoader(
        dataset, sampler, batch_size=batch_size, drop_last=drop_last, **dataloader_kwargs
    )


def _check_arguments(dataset: object, batch_size: int, kwargs: dict[str, Any]) -> None:
    for name in ("sampler", "batch_sampler"):
        if name in kwargs:
            raise ConfigError(
                f"{name}={kwargs[name]!r} cannot be passed to ddpkit.loader",
                hint="ddpkit.loader builds its own distributed sampler; use shuffle=, seed=, "
                "drop_last= and epoch=, or build a plain DataLoader yourself",
            )
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"dataset={type(dataset).__name__} is an IterableDataset, which has no indices "
            "to shard",
            hint="use a map-style Dataset (__getitem__ and __len__), or shard the stream "
            "yourself by ctx.rank/ctx.world_size and use a plain DataLoader",
        )
    if not isinstance(dataset, Sized):
        raise ConfigError(
            f"dataset={type(dataset).__name__} has no __len__",
            hint="ddpkit.loader shards by index and needs len(dataset)",
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive int", hint="e.g. 32")
