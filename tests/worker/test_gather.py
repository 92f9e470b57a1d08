"""ddpkit.gather: every sample exactly once per epoch, for world sizes 1, 2 and 3.

The dataset returns its own index, so gathering a batch says which samples came back. Sizes
7, 10, 11 with batches 2, 3, 4 leave padding and partial last batches for every world size.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker.gather import comm_device
from tests.support.distutil import Indices, run_workers, torchrun_env

SIZES = (7, 10, 11)
BATCHES = (2, 3, 4)
SEED = 11


def _permutation(size: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(SEED + epoch)  # DistributedSampler's recipe
    return torch.randperm(size, generator=generator).tolist()


def _gather_epoch(size: int, batch: int, shuffle: bool, drop_last: bool = False) -> dict[str, Any]:
    """One epoch over Indices(size), gathering three kinds of per-sample values per step."""
    rows: list[int] = []
    pairs: list[list[int]] = []
    names: list[str] = []
    loader = ddpkit.loader(Indices(size), batch, shuffle=shuffle, drop_last=drop_last, seed=SEED)
    for indices in loader:
        rows += ddpkit.gather(indices).tolist()  # 1-d tensor
        pairs += ddpkit.gather(torch.stack([indices, 10 * indices], dim=1)).tolist()  # 2-d
        names += ddpkit.gather([f"s{int(i)}" for i in indices])  # picklable objects
    return {"rows": rows, "pairs": pairs, "names": names, "epoch": loader.epoch}


def _run_all() -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for size, batch, shuffle in itertools.product(SIZES, BATCHES, (False, True)):
        seen[f"{size}-{batch}-{shuffle}"] = _gather_epoch(size, batch, shuffle)
    for size, batch in itertools.product(SIZES, (2, 3)):
        seen[f"{size}-{batch}-drop"] = _gather_epoch(size, batch, False, drop_last=True)
    return seen


def _check_all(seen: dict[str, Any], world_size: int) -> None:
    for size, batch, shuffle in itertools.product(SIZES, BATCHES, (False, True)):
        got = seen[f"{size}-{batch}-{shuffle}"]
        expected = _permutation(size, got["epoch"]) if shuffle else list(range(size))
        assert got["rows"] == expected, (size, batch, shuffle)  # each exactly once, in order
        assert got["pairs"] == [[i, 10 * i] for i in expected]
        assert got["names"] == [f"s{i}" for i in expected]
    for size, batch in itertools.product(SIZES, (2, 3)):
        per_rank = size // world_size  # the sampler drops the uneven tail...
        steps = per_rank // batch  # ...and the loader the partial last batch
        assert seen[f"{size}-{batch}-drop"]["rows"] == list(range(steps * batch * world_size))


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


def test_world_of_one_every_sample_once(world_of_one: ddpkit.Context) -> None:
    _check_all(_run_all(), 1)


def test_world_of_one_returns_x_unchanged(world_of_one: ddpkit.Context) -> None:
    for batch in ddpkit.loader(Indices(5), 2, shuffle=False):
        assert ddpkit.gather(batch) is batch
        names = [str(int(i)) for i in batch]
        assert ddpkit.gather(names) is names
        assert ddpkit.gather(tuple(names)) == names


def test_gather_outside_a_loader_loop(world_of_one: ddpkit.Context) -> None:
    loader = ddpkit.loader(Indices(4), 2)
    with pytest.raises(UsageError, match=r"outside a loop over a ddpkit\.loader"):
        ddpkit.gather(torch.zeros(2))
    for _ in loader:
        pass
    with pytest.raises(UsageError):  # a finished loop is no longer active
        ddpkit.gather(torch.zeros(2))


def test_nested_loops_hand_back_the_active_step(world_of_one: ddpkit.Context) -> None:
    outer = ddpkit.loader(Indices(4), 2, shuffle=False)
    inner = ddpkit.loader(Indices(3), 3, shuffle=False)
    for batch in outer:
        for small in inner:
            assert ddpkit.gather(small).tolist() == [0, 1, 2]
        assert ddpkit.gather(batch) is batch  # 2 rows: the outer loop's step again
        for _ in ddpkit.loader(Indices(9), 1):
            break  # an abandoned inner loop hands the step back too
        assert ddpkit.gather(batch) is batch


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.zeros(3), "gather expected 2 rows for step 0 of the epoch, got 3"),
        (torch.tensor(1.5), "gather expected 2 rows for step 0 of the epoch, got a 0-d tensor"),
        (["a"], "gather expected 2 rows for step 0 of the epoch, got 1"),
        ({"a": 1}, "got x of type dict"),
    ],
)
def test_wrong_rows_are_a_config_error(
    world_of_one: ddpkit.Context, value: Any, message: str
) -> None:
    for _ in ddpkit.loader(Indices(4), 2):
        with pytest.raises(ConfigError) as caught:
            ddpkit.gather(value)
        assert message in str(caught.value)
        break


def test_wrong_rows_on_the_last_step(world_of_one: ddpkit.Context) -> None:
    for step, batch in enumerate(ddpkit.loader(Indices(5), 2)):
        if step == 2:
            with pytest.raises(ConfigError, match="expected 1 rows for step 2") as caught:
                ddpkit.gather(torch.zeros(2))
            assert caught.value.hint is not None and "all_reduce scalars" in caught.value.hint
            assert ddpkit.gather(batch) is batch


@pytest.mark.parametrize(
    ("backend", "context_device", "tensor_device", "expected"),
    [
        ("gloo", "cpu", "cpu", "cpu"),
        ("gloo", "cuda:1", "cuda:1", "cpu"),  # gloo gathers on the CPU, the result goes back
        ("nccl", "cuda:1", "cpu", "cuda:1"),  # NCCL needs the rank's GPU
        ("nccl", "cuda:1", "cuda:1", "cuda:1"),
        ("cpu:gloo,cuda:nccl", "cuda:0", "cpu", "cpu"),
        ("cpu:gloo,cuda:nccl", "cuda:0", "cuda:0", "cuda:0"),
        ("cuda:nccl", "cuda:2", "cpu", "cuda:2"),
        ("mpi", "cpu", "cpu", "cpu"),
    ],
)
def test_comm_device(backend: str, context_device: str, tensor_device: str, expected: str) -> None:
    got = comm_device(backend, torch.device(context_device), torch.device(tensor_device))
    assert got == torch.device(expected)


def test_gather_before_init() -> None:
    with pytest.raises(UsageError, match="init"):
        ddpkit.gather(torch.zeros(1))


def _gather_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    seen = _run_all()
    for batch in ddpkit.loader(Indices(6), 2):
        try:  # every rank passes one row too few: all raise before any collective
            ddpkit.gather(batch[:1])
        except ConfigError as exc:
            seen["wrong_rows"] = str(exc)
        try:  # trailing shapes differ between ranks: gloo would abort the process
            ddpkit.gather(torch.zeros(2, 2 + rank))
        except ConfigError as exc:
            seen["wrong_shape"] = str(exc)
        seen["still_works"] = sorted(ddpkit.gather(batch).tolist())
        break
    seen.update(_steady_state(rank, world_size))
    dist.barrier()  # nobody tears down while a peer still works
    ddpkit.shutdown()
    return seen


def _steady_state(rank: int, world_size: int) -> dict[str, Any]:
    """After a pass's first step, one all_gather per gather (the signature rides in a header),
    and still: a shape that every rank changes alike is followed, one rank's is an error."""
    seen: dict[str, Any] = {}
    calls: list[int] = []
    flat = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real, real_into = dist.all_gather, getattr(dist, flat)

    def counting(real: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return real(*args, **kwargs)

        return counted

    # this worker process's own module: no other test sees them
    dist.all_gather = counting(real)
    setattr(dist, flat, counting(real_into))
    caught = warnings.catch_warnings(record=True)
    warned = caught.__enter__()
    warnings.simplefilter("always")  # torch's deprecation of a collective would land here
    try:
        rows: list[int] = []
        wide: list[list[float]] = []
        even: list[bool] = []
        for step, batch in enumerate(ddpkit.loader(Indices(6 * world_size), 2, shuffle=False)):
            rows += ddpkit.gather(batch).tolist()
            width = 3 if step == 0 else 5  # every rank widens alike at step 1
            wide += ddpkit.gather(torch.full((2, width), float(rank), dtype=torch.float64)).tolist()
            even += ddpkit.gather(batch % 2 == 0).tolist()  # bool rows through the header path
        seen["steady_calls"] = len(calls)
        seen["steady_rows"], seen["steady_wide"], seen["steady_even"] = rows, wide, even
        for step, batch in enumerate(ddpkit.loader(Indices(4 * world_size), 2, shuffle=False)):
            try:  # agreed at step 0; at step 1 rank 1 alone sends wider rows
                ddpkit.gather(torch.zeros(2, 3 if step == 1 and rank == 1 else 2))
            except ConfigError as exc:
                seen["late_mismatch"] = str(exc)
            seen["after_late_mismatch"] = sorted(ddpkit.gather(batch).tolist())
    finally:
        dist.all_gather = real
        setattr(dist, flat, real_into)
        caught.__exit__(None, None, None)
    seen["warnings"] = [f"{w.category.__name__}: {w.message}" for w in warned]
    return seen


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_sample_once_in_a_real_group(world_size: int) -> None:
    results = run_workers(_gather_worker, world_size)
    for seen in results:
        _check_all(seen, world_size)
        assert "gather expected 2 rows for step 0 of the epoch, got 1" in seen["wrong_rows"]
        assert "rank 0: ((2, 2), 'torch.float32')" in seen["wrong_shape"]
        assert "rank 1: ((2, 3), 'torch.float32')" in seen["wrong_shape"]
        assert len(seen["still_works"]) == 2 * world_size
        # 3 steps x 3 gathers: the first step checks each signature apart (2 collectives
        # each), the widening at step 1 costs one gather again, every other gather is one
        # collective (the old way: 2 x 9 = 18)
        assert seen["steady_calls"] == 3 * 2 + (1 + 2 + 1) + 3 * 1, seen["steady_calls"]
        assert seen["warnings"] == []  # e.g. no FutureWarning of a deprecated collective
        assert seen["steady_rows"] == list(range(6 * world_size))
        assert [row[0] for row in seen["steady_wide"]] == [float(r % world_size) for r in
                                                           range(6 * world_size)]  # fmt: skip
        assert [len(row) for row in seen["steady_wide"]] == [3] * 2 * world_size + [5] * (
            4 * world_size
        )
        assert seen["steady_even"] == [i % 2 == 0 for i in range(6 * world_size)]
        assert "rank 1: ((2, 3), 'torch.float32')" in seen["late_mismatch"]
        assert "rank 0: ((2, 2), 'torch.float32')" in seen["late_mismatch"]
        assert len(seen["after_late_mismatch"]) == 2 * world_size
    assert all(seen == results[0] for seen in results)  # every rank gets the same answer
