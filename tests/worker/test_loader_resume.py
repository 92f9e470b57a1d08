"""DistributedLoader state: a mid-epoch resume skips batches unread, gather stays right."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import Dataset

import ddpkit
from ddpkit.errors import ConfigError
from tests.support.distutil import free_port, run_workers, torchrun_env


class Counting(Dataset[int]):
    """dataset[i] == i, counting which indices were read."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.reads: Counter[int] = Counter()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        self.reads[index] += 1
        return index


def _batches(loader: Any) -> list[list[int]]:
    return [[int(i) for i in batch] for batch in loader]


def _interrupted(size: int, batch_size: int, k: int, **kwargs: Any) -> dict[str, Any]:
    """The state of a loader that yielded ``k`` batches of its first pass and was stopped."""
    first = ddpkit.loader(Counting(size), batch_size, seed=11, **kwargs)
    if k == 0:
        return first.state_dict()
    for done, _ in enumerate(first, start=1):
        if done == k:
            break
    return first.state_dict()


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


@pytest.mark.parametrize("k", [0, 1, 2, "all"])  # "all": the last batch yielded, loop not ended
@pytest.mark.parametrize(("size", "drop_last"), [(10, False), (10, True), (12, False)])
def test_resume_mid_epoch_world_of_one(
    world_of_one: ddpkit.Context, size: int, drop_last: bool, k: int | str
) -> None:
    reference = ddpkit.loader(Counting(size), 3, seed=11, drop_last=drop_last)
    epochs = [_batches(reference) for _ in range(3)]
    k = len(epochs[0]) if k == "all" else k
    assert isinstance(k, int)
    state = _interrupted(size, 3, k, drop_last=drop_last)
    assert (state["epoch"], state["batches"]) == (0, k)
    data = Counting(size)
    resumed = ddpkit.loader(data, 3, seed=11, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # nothing consumed yet: the loaded position
    assert _batches(resumed) == epochs[0][k:]  # empty when k covered the whole pass
    assert set(data.reads) == {i for batch in epochs[0][k:] for i in batch}  # skipped: unread
    assert max(data.reads.values(), default=1) == 1
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["batches"] == 0
    assert [_batches(resumed) for _ in range(2)] == epochs[1:]


def test_state_during_and_after_a_pass(world_of_one: ddpkit.Context) -> None:
    loader = ddpkit.loader(Counting(7), 2, seed=1, epoch=3)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (3, 0)
    positions = [(loader.state_dict()["epoch"], loader.state_dict()["batches"]) for _ in loader]
    assert positions == [(3, 1), (3, 2), (3, 3), (3, 4)]
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (4, 0)
    assert loader.state_dict()["world_size"] == 1 and loader.state_dict()["seed"] == 1


def test_resumed_steps_continue_for_gather(world_of_one: ddpkit.Context) -> None:
    state = _interrupted(10, 3, 2, shuffle=False)
    resumed = ddpkit.loader(Counting(10), 3, seed=11, shuffle=False)
    resumed.load_state_dict(state)
    for batch in resumed:  # step 2 of 4: the last is a partial batch of one row
        assert ddpkit.gather(batch).tolist() == batch.tolist()
    assert batch.tolist() == [9]


def test_resume_with_worker_processes(world_of_one: ddpkit.Context) -> None:
    reference = _batches(ddpkit.loader(Counting(13), 2, seed=11))
    resumed = ddpkit.loader(Counting(13), 2, seed=11, num_workers=2)
    resumed.load_state_dict(_interrupted(13, 2, 4))
    assert _batches(resumed) == reference[4:]


def test_state_goes_through_a_checkpoint(world_of_one: ddpkit.Context, tmp_path: Any) -> None:
    state = _interrupted(10, 2, 3)
    first = ddpkit.loader(Counting(10), 2, seed=11)
    first.load_state_dict(state)
    ddpkit.save_checkpoint(tmp_path, {"loader": first}, step=3)
    resumed = ddpkit.loader(Counting(10), 2, seed=11)
    assert ddpkit.load_checkpoint(tmp_path, {"loader": resumed}) == 3
    assert resumed.state_dict() == state


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"world_size": 0}, "world_size=0"),  # another world size is remapped (test_reshard)
        ({"start": 11}, "start=11"),
        ({"seed": 12}, "seed=12"),
        ({"dataset_len": 9}, "dataset_len=9"),
        ({"batches": -1}, "batches=-1"),
        ({"epoch": -2}, "epoch=-2"),
    ],
)
def test_load_state_dict_rejects(
    world_of_one: ddpkit.Context, change: dict[str, Any], match: str
) -> None:
    state = {**_interrupted(10, 3, 1), **change}
    with pytest.raises(ConfigError, match=match) as caught:
        ddpkit.loader(Counting(10), 3, seed=11).load_state_dict(state)
    assert caught.value.hint


# --- world size 2, spawned ---------------------------------------------------------------------


def _resume_worker(rank: int, world_size: int, port: int, k: int) -> dict[str, Any]:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    try:
        reference = ddpkit.loader(Counting(11), 2, seed=11)
        epochs = [_batches(reference) for _ in range(2)]
        full = ddpkit.loader(Counting(11), 2, seed=11)
        gathered = [ddpkit.gather(batch).tolist() for batch in full]
        state = _interrupted(11, 2, k)
        data = Counting(11)
        resumed = ddpkit.loader(data, 2, seed=11)
        resumed.load_state_dict(state)
        rest, rest_gathered = [], []
        for batch in resumed:
            rest.append(batch.tolist())
            rest_gathered.append(ddpkit.gather(batch).tolist())
        return {
            "state": state,
            "rest_ok": rest == epochs[0][k:],
            "reads": sorted(data.reads.elements()),
            "expected_reads": sorted(i for batch in epochs[0][k:] for i in batch),
            "gather_ok": rest_gathered == gathered[k:],
            "gathered": gathered,
            "next_ok": _batches(resumed) == epochs[1],
        }
    finally:
        ddpkit.shutdown()


@pytest.mark.parametrize("k", [1, 2])
def test_resume_mid_epoch_two_ranks(k: int) -> None:
    # 11 samples over 2 ranks: 6 per rank (one padding position), batches of 2: 3 steps
    for rank, result in enumerate(run_workers(_resume_worker, 2, k)):
        assert result["state"]["batches"] == k and result["state"]["world_size"] == 2, rank
        assert result["rest_ok"] and result["next_ok"], rank
        assert result["reads"] == result["expected_reads"], rank
        assert len(result["reads"]) == (3 - k) * 2, rank
        assert result["gather_ok"], rank
        everything = [i for step in result["gathered"] for i in step]
        assert sorted(everything) == list(range(11)), rank  # exactly once, padding cut


# --- len(loader) during a resumed pass ---------------------------------------------------------


def _len_worker(rank: int, world_size: int, port: int) -> list[str]:
    """Every mismatch between len() and the batches yielded, over drop_last and positions."""
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    wrong: list[str] = []
    try:
        for drop_last in (False, True):
            full = len(ddpkit.loader(Counting(23), 3, seed=11, drop_last=drop_last))
            for k in range(full + 1):
                where = f"rank {rank} of {world_size}, drop_last={drop_last}, k={k}"
                resumed = ddpkit.loader(Counting(23), 3, seed=11, drop_last=drop_last)
                resumed.load_state_dict(_interrupted(23, 3, k, drop_last=drop_last))
                before = len(resumed)
                for label in ("resumed pass", "next pass"):
                    iterator = iter(resumed)
                    expected = [len(resumed), len(iterator)]
                    during = [(len(resumed), len(iterator)) for _ in iterator]
                    yielded = len(during)
                    if label == "resumed pass" and before != yielded:
                        wrong.append(f"{where}: len {before} before a pass of {yielded}")
                    if set(during) - {(yielded, yielded)} or expected != [yielded, yielded]:
                        wrong.append(f"{where}: {label} of {yielded}: {expected}, {during}")
                    if len(resumed) != full:
                        wrong.append(f"{where}: len {len(resumed)} after the {label}, not {full}")
                    if label == "next pass" and yielded != full:
                        wrong.append(f"{where}: the next pass yielded {yielded}, not {full}")
                if (k == full) != (before == 0):
                    wrong.append(f"{where}: len {before} before the resumed pass")
    finally:
        ddpkit.shutdown()
    return wrong


def test_len_counts_the_batches_of_a_resumed_pass_world_of_one() -> None:
    assert _len_worker(0, 1, free_port()) == []


@pytest.mark.parametrize("world_size", [2, 3])
def test_len_counts_the_batches_of_a_resumed_pass(world_size: int) -> None:
    assert run_workers(_len_worker, world_size) == [[]] * world_size
