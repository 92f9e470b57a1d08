"""ddpkit.clip_grad_norm_: the norm one process computes over the same samples.

On real gloo groups of 1, 2 and 3 ranks, for DDP, FSDP2, ddpkit's DataParallel and a plain
model (the four one after the other on one group per world size, in the launch of
tests/worker/test_loop_ranks.py that the loop's other features share), over the first
window of 3 micro-steps (a short last batch at 3 ranks): before the window's end the norm is
that of this rank's samples so far; under FSDP2 a UsageError where the window skipped its sync
(1 and 2 ranks: the gradients are not in ``.grad`` yet), and every rank's samples so far at 3
ranks, where the window holds the shorter last batch and reduce-scatters each micro-step. After
it, the norm is that of the window's samples (every rank's under DDP and FSDP2), and the
clipped gradients (FSDP2's DTensor shards gathered whole) are those torch clips on one process.
A norm taken over FSDP2's local shards only is smaller than one process's: the check fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.errors import ConfigError, UsageError
from tests.worker.test_accumulate import (
    everyone,
    full,
    make_data,
    make_model,
    window_grads,
    wrapped,
)

BATCH, EVERY = 3, 3


def _norm(grads: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


KINDS = ("ddp", "fsdp", "dp", "plain")
SYNCED = ("ddp", "fsdp")  # their gradients are every rank's samples'


def _clip(kind: str, world_size: int) -> dict[str, Any]:
    """The norms and clipped gradients of the first window on a ``kind`` model."""
    reference = make_model()
    model = wrapped(kind, make_model(), [])
    seen: dict[str, Any] = {"partial": []}
    mine: list[tuple[torch.Tensor, torch.Tensor]] = []
    window: list[tuple[torch.Tensor, torch.Tensor]] = []
    for x, y in ddpkit.loader(make_data(), BATCH, shuffle=True, seed=3):
        with ddpkit.accumulate(model, every=EVERY) as micro:
            F.mse_loss(model(x), y).backward()
        mine.append((x, y))
        window.append((everyone(x, world_size), everyone(y, world_size)) if kind in SYNCED
                      else (x, y))  # fmt: skip
        if not micro.sync:  # the samples so far (max_norm too large to clip): this rank's,
            # or every rank's under FSDP2 where it reduce-scatters on every micro-step
            so_far = window if kind == "fsdp" else mine
            try:
                got = ddpkit.clip_grad_norm_(model, 1e9)
            except UsageError as error:  # FSDP2 skipped the sync: .grad is not the window's
                seen["partial"].append(str(error))
                continue
            seen["partial"].append((float(got), _norm(window_grads(reference, so_far))))
            continue
        expected = window_grads(reference, window)
        for grad, p in zip(expected, reference.parameters(), strict=True):
            p.grad = grad
        one = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
        got = ddpkit.clip_grad_norm_(model, 0.05)
        seen["norm"] = (float(got), one, type(got).__name__)
        clipped = [full(p.grad) for p in model.parameters() if p.grad is not None]
        seen["clipped_match"] = all(
            torch.allclose(c, p.grad, rtol=1e-5, atol=1e-7)  # type: ignore[arg-type]
            for c, p in zip(clipped, reference.parameters(), strict=True)
        )
        seen["clipped_norm"] = _norm(clipped)
        break
    return seen


def clip_cases(world_size: int) -> dict[str, dict[str, Any]]:
    """Every kind of model, one after the other, on this rank's group."""
    return {kind: _clip(kind, world_size) for kind in KINDS}


def check_clip(by_kind: dict[str, dict[str, Any]], rank: int, world_size: int) -> None:
    """The norm is one process's over the same samples; the clipped gradients are torch's."""
    assert list(by_kind) == list(KINDS)
    for kind, seen in by_kind.items():
        where = f"{kind}, rank {rank} of {world_size}"
        assert len(seen["partial"]) == EVERY - 1, where
        if kind == "fsdp" and world_size < 3:  # a uniform window: FSDP2 skipped the sync
            assert all("inside an FSDP2 accumulation window" in p for p in seen["partial"]), (
                where,
                seen["partial"],
            )
            seen["partial"] = []
        for got, expected in seen["partial"]:
            assert got == pytest.approx(expected, rel=1e-5), where
        got, full, typename = seen["norm"]
        assert typename == "Tensor", where
        assert got == pytest.approx(full, rel=1e-5), where
        assert full > 0.05, where  # it did clip
        assert seen["clipped_match"], where
        assert seen["clipped_norm"] == pytest.approx(0.05, rel=1e-4), where


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


def test_inside_the_block_is_a_usage_error(world_of_one: ddpkit.Context) -> None:
    model = make_model()
    x, y = make_data().tensors
    with (
        pytest.raises(UsageError, match="read inside") as caught,
        ddpkit.accumulate(model, every=2),
    ):
        F.mse_loss(model(x), y).backward()
        ddpkit.clip_grad_norm_(model, 1.0)
    assert caught.value.hint is not None and "after the block" in caught.value.hint


def test_no_gradient_and_a_bad_model(world_of_one: ddpkit.Context) -> None:
    assert float(ddpkit.clip_grad_norm_(nn.Linear(2, 2), 1.0)) == 0.0
    with pytest.raises(ConfigError, match=r"got list, not an nn\.Module"):
        ddpkit.clip_grad_norm_([torch.zeros(1)], 1.0)  # type: ignore[arg-type]
