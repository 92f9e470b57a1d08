"""ddpkit.accumulate: DDP's sync skipped between micro-steps, a window's gradients exact.

On real gloo groups of 1, 2 and 3 ranks, for DDP, FSDP2, ddpkit's DataParallel and a plain model
(the four one after the other on one group per world size, in the launch of
tests/worker/test_loop_ranks.py that the loop's other features share): 23 samples in batches of
3 with windows of 3 give full windows, a window cut by the epoch's end and a short last batch at
every world size (padding too at 3 ranks). Each window's gradients are compared with one
backward over the window's samples taken together (all ranks' under DDP and FSDP2, the rank's
own otherwise), and DDP's communication hook counts the all-reduces of each micro-step. Under
FSDP2 the test counts the reduce-scatters (``dist.reduce_scatter_single``, what FSDP2 calls,
wrapped for the FSDP2 case only; none at 1 rank) and sees which micro-steps wrote the sharded
``.grad``: one per window, but every micro-step of the window holding the pass's shorter last
batch (1 and 3 ranks; at 2 ranks every batch holds 3 rows); a loop that jumps into that batch
from a window that skipped its sync gets a UsageError (1 rank).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker.dataparallel import DataParallel

SAMPLES, BATCH, EVERY, EPOCHS = 23, 3, 3, 2


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(SAMPLES, 4, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    )


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def expected_syncs(world_size: int) -> list[int]:
    """The steps of an epoch whose micro-step ends a window: every EVERY-th and the last."""
    per_rank = -(-SAMPLES // world_size)  # the sampler pads to equal shards
    steps = -(-per_rank // BATCH)
    return [s for s in range(steps) if (s + 1) % EVERY == 0 or s == steps - 1]


def batch_rows(world_size: int) -> list[int]:
    """Each step's rows on every rank (the last batch is often shorter)."""
    per_rank = -(-SAMPLES // world_size)
    return [min(BATCH, per_rank - start) for start in range(0, per_rank, BATCH)]


def fsdp_syncs(world_size: int) -> list[bool]:
    """Which micro-steps FSDP2 reduce-scatters: a window's last, and every one of a window
    whose batches differ in size (the one holding the shorter last batch)."""
    rows, ends = batch_rows(world_size), expected_syncs(world_size)
    starts = [0, *[end + 1 for end in ends[:-1]]]
    wanted = [step in ends for step in range(len(rows))]
    for start, end in zip(starts, ends, strict=True):
        if len(set(rows[start : end + 1])) > 1:
            wanted[start : end + 1] = [True] * (end + 1 - start)
    return wanted


@contextmanager
def counting_reduce_scatters(calls: list[int]) -> Iterator[None]:
    """Every ``dist.reduce_scatter_single`` call (FSDP2's reduce-scatter) appends to ``calls``."""
    original = dist.reduce_scatter_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counting
    try:
        yield
    finally:
        dist.reduce_scatter_single = original


def window_grads(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    """The gradients of one backward over ``batches`` taken together as one batch."""
    model.zero_grad(set_to_none=True)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def everyone(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's rows (padding kept: it is what DDP averaged over), rank after rank."""
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


def full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient whole: FSDP2's are sharded DTensors."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def wrapped(kind: str, model: nn.Module, calls: list[int]) -> nn.Module:
    if kind == "ddp":
        ddp = ddpkit.wrap(model, "ddp")

        # no annotations: DDP compares the hook's to dist.GradBucket, and here they are strings
        def counting(state, bucket):  # type: ignore[no-untyped-def]
            calls.append(1)
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting)  # type: ignore[operator]
        return ddp
    if kind == "fsdp":
        return ddpkit.wrap(model, "fsdp")
    return DataParallel(model) if kind == "dp" else model  # DataParallel passes through on CPU


KINDS = ("ddp", "fsdp", "dp", "plain")


def _accumulate(kind: str, world_size: int) -> dict[str, Any]:
    """EPOCHS epochs of accumulation windows on a ``kind`` model: what each micro-step did."""
    reference = make_model()
    calls: list[int] = []
    model = wrapped(kind, make_model(), calls)
    train = ddpkit.loader(make_data(), BATCH, shuffle=True, seed=3)
    seen: dict[str, Any] = {"syncs": [], "allreduced": [], "indices": [], "windows": []}
    seen["reduce_scatters"], seen["written"] = [], []
    with counting_reduce_scatters(calls) if kind == "fsdp" else nullcontext():
        for _ in range(EPOCHS):
            _epoch(
                kind,
                world_size,
                model=model,
                reference=reference,
                train=train,
                calls=calls,
                seen=seen,
            )
        if kind == "fsdp":
            seen["jump"] = _jump(world_size)
    return seen


def _epoch(
    kind: str,
    world_size: int,
    *,
    model: nn.Module,
    reference: nn.Module,
    train: Any,
    calls: list[int],
    seen: dict[str, Any],
) -> None:
    window: list[tuple[torch.Tensor, torch.Tensor]] = []
    syncs, allreduced, indices, counts, written = [], [], [], [], []
    for step, (x, y) in enumerate(train):
        before, marks = len(calls), grad_marks(model)
        with ddpkit.accumulate(model, every=EVERY) as micro:
            F.mse_loss(model(x), y).backward()
        allreduced.append(len(calls) > before)
        counts.append(len(calls) - before)
        written.append(grad_marks(model) != marks)
        indices.append(micro.index)
        if kind in ("ddp", "fsdp"):  # the gradient is every rank's samples'
            x, y = everyone(x, world_size), everyone(y, world_size)
        window.append((x, y))
        if micro.sync:
            syncs.append(step)
            got = [full(p.grad) for p in model.parameters() if p.grad is not None]
            expected = window_grads(reference, window)
            close = len(got) == len(expected) and all(
                torch.allclose(g, e, rtol=1e-5, atol=1e-6)
                for g, e in zip(got, expected, strict=True)
            )
            seen["windows"].append((len(window), close))
            if kind == "ddp":  # the synced gradients: the same on every rank
                flat = torch.cat([g.reshape(-1) for g in got])
                seen["windows"][-1] += (bool((everyone(flat[None], world_size) == flat).all()),)
            model.zero_grad(set_to_none=True)
            window = []
    seen["syncs"].append(syncs)
    seen["allreduced"].append(allreduced)
    seen["indices"].append(indices)
    seen["reduce_scatters"].append(counts)
    seen["written"].append(written)


def _jump(world_size: int) -> str:
    """An FSDP2 loop that runs the first batch, then jumps to the pass's last: at 1 rank the
    first window skipped its sync and the last batch is shorter, so the second micro-step
    raises; at 2 (no short batch) and 3 ranks (the window holds it: it syncs) it runs."""
    model = ddpkit.wrap(make_model(), "fsdp")
    train = ddpkit.loader(make_data(), BATCH, shuffle=True, seed=3)
    try:
        for step, (x, y) in enumerate(train):
            if step in (0, len(train) - 1):
                with ddpkit.accumulate(model, every=EVERY):
                    F.mse_loss(model(x), y).backward()
    except UsageError as error:
        return str(error)
    return ""


def grad_marks(model: nn.Module) -> list[tuple[int, int]]:
    """Which gradient tensor each parameter holds, and its in-place version (FSDP2 adds into
    a DTensor's local shard: that one's)."""
    return [
        (-1, -1) if p.grad is None else (id(p.grad), local(p.grad)._version)
        for p in model.parameters()
    ]


def local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def accumulate_cases(world_size: int) -> dict[str, dict[str, Any]]:
    """Every kind of model, one after the other, on this rank's group."""
    return {kind: _accumulate(kind, world_size) for kind in KINDS}


def check_accumulate(by_kind: dict[str, dict[str, Any]], rank: int, world_size: int) -> None:
    """Each window's gradients are one larger batch's; DDP syncs on a window's last step only."""
    syncs = expected_syncs(world_size)
    steps = syncs[-1] + 1
    starts = [0, *[s + 1 for s in syncs[:-1]]]
    sizes = [len(range(start, end + 1)) for start, end in zip(starts, syncs, strict=True)]
    assert list(by_kind) == list(KINDS)
    for kind, seen in by_kind.items():
        where = f"{kind}, rank {rank} of {world_size}"
        assert seen["syncs"] == [syncs] * EPOCHS, where  # each epoch starts a new window
        # DDP all-reduces on the window's last micro-step only; the others never
        wanted = [step in syncs for step in range(steps)] if kind == "ddp" else [False] * steps
        if kind == "fsdp":  # FSDP2 reduce-scatters (and writes .grad) as fsdp_syncs says
            wanted = fsdp_syncs(world_size) if world_size > 1 else [False] * steps
            assert seen["written"] == [fsdp_syncs(world_size)] * EPOCHS, where
            counts = {n for epoch in seen["reduce_scatters"] for n in epoch if n}
            assert len(counts) == (world_size > 1), (where, counts)  # one round each time
            jumped = "a micro-step of 2 rows in an FSDP2 accumulation window" in seen["jump"]
            assert jumped if world_size == 1 else not seen["jump"], (where, seen["jump"])
        assert seen["allreduced"] == [wanted] * EPOCHS, where
        micro = [s - max(b for b in starts if b <= s) for s in range(steps)]
        assert seen["indices"][0] == micro, where
        assert [w[0] for w in seen["windows"]] == sizes * EPOCHS, where
        assert all(w[1] for w in seen["windows"]), (where, seen["windows"])
        if kind == "ddp":
            assert all(w[2] for w in seen["windows"]), (where, seen["windows"])


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


def test_a_plain_iterable_counts_micro_steps(world_of_one: ddpkit.Context) -> None:
    model, reference = make_model(), make_model()
    data = make_data()
    batches = [(data.tensors[0][i : i + 4], data.tensors[1][i : i + 4]) for i in (0, 4, 8, 12)]
    flags = []
    for number, (x, y) in enumerate(batches):
        with ddpkit.accumulate(model, every=3, last=number == len(batches) - 1) as micro:
            F.mse_loss(model(x), y).backward()
        flags.append(micro.sync)
        if number == 2:  # a window of 3 equal micro-steps: the mean of their gradients
            expected = window_grads(reference, batches[:3])
            assert all(
                torch.allclose(p.grad, e, atol=1e-6)  # type: ignore[arg-type]
                for p, e in zip(model.parameters(), expected, strict=True)
            )
            model.zero_grad(set_to_none=True)
    assert flags == [False, False, True, True]  # last=True ends the second window early
    expected = window_grads(reference, batches[3:])
    assert all(
        torch.allclose(p.grad, e, atol=1e-6)  # type: ignore[arg-type]
        for p, e in zip(model.parameters(), expected, strict=True)
    )


def test_a_loader_batch_split_into_micro_steps(world_of_one: ddpkit.Context) -> None:
    """Two micro-steps per batch of 4: each weighs the same (the loader's rows no longer
    apply), and the end of the data is the caller's `last=`."""
    model, reference = make_model(), make_model()
    data = TensorDataset(*(t[:12] for t in make_data().tensors))
    train = ddpkit.loader(data, 4, shuffle=False)
    flags, chunks = [], []
    for step, (x, y) in enumerate(train):
        for half in (0, 1):
            chunk = (x[2 * half : 2 * half + 2], y[2 * half : 2 * half + 2])
            last = step == len(train) - 1 and half == 1
            with ddpkit.accumulate(model, every=4, last=last) as micro:
                F.mse_loss(model(chunk[0]), chunk[1]).backward()
            flags.append(micro.sync)
            chunks.append(chunk)
            if micro.sync:
                expected = window_grads(reference, chunks)
                assert all(
                    torch.allclose(p.grad, e, atol=1e-6)  # type: ignore[arg-type]
                    for p, e in zip(model.parameters(), expected, strict=True)
                ), len(flags)
                model.zero_grad(set_to_none=True)
                chunks = []
    assert flags == [False, False, False, True, False, True]


def test_every_one_leaves_the_gradients_alone(world_of_one: ddpkit.Context) -> None:
    model, reference = make_model(), make_model()
    x, y = make_data().tensors
    with ddpkit.accumulate(model, every=1) as micro:
        F.mse_loss(model(x), y).backward()
    assert micro.sync and micro.index == 0
    expected = window_grads(reference, [(x, y)])
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True))  # type: ignore[arg-type]


def test_backward_outside_the_block_is_a_usage_error(world_of_one: ddpkit.Context) -> None:
    model = make_model()
    x, y = make_data().tensors
    with (
        pytest.raises(UsageError, match="no gradient was computed inside") as caught,
        ddpkit.accumulate(model, every=2),
    ):
        loss = F.mse_loss(model(x), y)
    assert caught.value.hint is not None and "inside the block" in caught.value.hint
    loss.backward()


@pytest.mark.parametrize(
    ("model", "every", "message"),
    [
        (nn.Linear(1, 1), 0, "accumulate(every=0) must be a positive int"),
        (nn.Linear(1, 1), True, "accumulate(every=True) must be a positive int"),
        ("model", 2, "accumulate(model) got str, not an nn.Module"),
    ],
)
def test_bad_arguments(world_of_one: ddpkit.Context, model: Any, every: Any, message: str) -> None:
    with pytest.raises(ConfigError) as caught, ddpkit.accumulate(model, every=every):
        pass
    assert message in str(caught.value)


def test_the_wrapped_and_the_bare_model_share_a_window(world_of_one: ddpkit.Context) -> None:
    bare = make_model()
    model = DataParallel(bare)
    x, y = make_data().tensors
    with ddpkit.accumulate(model, every=2) as first:
        F.mse_loss(model(x), y).backward()
    with ddpkit.accumulate(bare, every=2) as second:
        F.mse_loss(bare(x), y).backward()
    assert (first.sync, second.sync) == (False, True)
    copy.deepcopy(first)  # a MicroStep is a plain value
