"""``wrap(model, precision=...)`` and ``ddpkit.grad_scaler``, on real gloo groups on CPU.

bf16: the forward computes in bfloat16 and returns float32, and a few steps of DDP, ddpkit's
DataParallel (a pass-through on CPU) and a plain model at 1, 2 and 3 ranks give the losses of
the same loop written with ``torch.autocast`` by hand. fp16 (torch
runs it on CPU too, with ``GradScaler("cpu")``): through a window of ``ddpkit.accumulate``
the scaler's gradients, once unscaled, are those of the unscaled backward; an overflow skips
the step and halves the scale; the scale travels through ``save_checkpoint`` /
``load_checkpoint`` (weights-only); stepping mid-window and clipping scaled gradients are
refused. Both run in the launch of tests/worker/test_loop_ranks.py (at 1, 2 and 3 ranks) that the
loop's other features share. The CUDA paths are the same calls on
another device type, not run here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker.dataparallel import DataParallel

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(rank: int, step: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 1, generator=generator)
    return x * scale, y * scale


BF16_KINDS = ("ddp", "dp", "plain")


def _bf16_pair(kind: str) -> tuple[nn.Module, nn.Module]:
    """(``kind`` wrapped with precision="bf16", the same model for the loop by hand)."""
    if kind == "ddp":
        return ddpkit.wrap(_model(), "ddp", precision="bf16"), DistributedDataParallel(_model())
    model = ddpkit.wrap(_model(), "single", precision="bf16")
    # ddpkit's DataParallel passes through on CPU (wrap's "dp" is one process's: refused at
    # world sizes above 1, the plain model on a CPU)
    return (DataParallel(model) if kind == "dp" else model), _model()


def _bf16(rank: int, kind: str) -> dict[str, Any]:
    model, by_hand = _bf16_pair(kind)
    seen: dict[str, Any] = {"inner": [], "losses": [], "by_hand": []}
    ddpkit.unwrap(model)[0].register_forward_hook(
        lambda module, args, out: seen["inner"].append(str(out.dtype))
    )
    for net, key in ((model, "losses"), (by_hand, "by_hand")):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = _batch(rank, step)
            if net is by_hand:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = net(x)
                out = out.float()
            else:
                out = net(x)
                seen["out"] = str(out.dtype)
            loss = F.mse_loss(out, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen[key].append(float(loss))
    seen["params"] = sorted({str(p.dtype) for p in model.parameters()})
    seen["disabled"] = not ddpkit.grad_scaler(model).is_enabled()
    return seen


def _check_bf16(by_kind: dict[str, dict[str, Any]], world_size: int) -> None:
    """bf16 runs the forward under autocast and returns float32, on every kind of model."""
    assert list(by_kind) == list(BF16_KINDS)
    for kind, seen in by_kind.items():
        where = f"{kind} at {world_size} ranks"
        assert seen["inner"] == ["torch.bfloat16"] * STEPS, where  # the Linear computed in bf16
        assert seen["out"] == "torch.float32", where
        assert seen["params"] == ["torch.float32"], where
        assert seen["losses"] == pytest.approx(seen["by_hand"], rel=1e-6), where
        assert seen["losses"][-1] < seen["losses"][0] or world_size != 1, where  # it trains
        assert seen["disabled"], where  # no loss scaling in bf16


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _fp16(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    model = ddpkit.wrap(_model(), "ddp", precision="fp16")
    plain = copy.deepcopy(ddpkit.unwrap(model))  # the same fp16 forward, unscaled backward
    scaler = ddpkit.grad_scaler(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[str, Any] = {"enabled": scaler.is_enabled(), "scale0": scaler.get_scale()}
    for index in range(2):  # one window of two micro-steps, small enough not to overflow
        x, y = _batch(rank, index, scale=0.01)
        with ddpkit.accumulate(model, every=2, last=index == 1) as micro:
            scaler.scale(F.mse_loss(model(x), y)).backward()
        with ddpkit.accumulate(plain, every=2, last=index == 1):
            F.mse_loss(plain(x), y).backward()
        if not micro.sync:
            for call in (scaler.update, lambda: scaler.step(optimizer)):
                try:
                    call()
                except UsageError as error:
                    seen.setdefault("mid_window", []).append(error.message)
    try:
        ddpkit.clip_grad_norm_(model, 1e9)
    except UsageError as error:
        seen["clip_scaled"] = error.message
    scaled = _grads(model)
    scaler.unscale_(optimizer)
    unscaled = _grads(model)
    mine = _grads(plain)  # this rank's own: average them across ranks as DDP did
    for grad in mine:
        dist.all_reduce(grad)
        grad /= world_size
    seen["ratio"] = float(scaled[0].norm() / unscaled[0].norm())
    seen["unscaled_match"] = all(
        torch.allclose(a, b, rtol=1e-2, atol=1e-6) for a, b in zip(unscaled, mine, strict=True)
    )
    ddpkit.clip_grad_norm_(model, 1e9)  # unscaled now: allowed
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    seen["stepped"] = any(
        not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )
    optimizer.zero_grad()
    x, y = _batch(rank, 9, scale=1e5)  # float16 overflows: the step is skipped
    with ddpkit.accumulate(model, every=1):
        scaler.scale(F.mse_loss(model(x), y)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    after = list(model.parameters())
    seen["skipped"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    seen["scale_after_overflow"] = scaler.get_scale()
    ddpkit.save_checkpoint(folder, {"model": model}, step=1)
    fresh = ddpkit.wrap(_model(), "ddp", precision="fp16")
    seen["fresh_scale"] = ddpkit.grad_scaler(fresh).get_scale()
    ddpkit.load_checkpoint(folder, {"model": fresh})
    seen["loaded_scale"] = ddpkit.grad_scaler(fresh).get_scale()
    return seen


def _check_fp16(seen: dict[str, Any]) -> None:
    """fp16's scaler through a window, an overflow and a checkpoint."""
    assert seen["enabled"]
    assert len(seen["mid_window"]) == 2  # update and step refused inside the window
    assert "accumulation window open" in seen["mid_window"][0]
    assert "loss scale" in seen["clip_scaled"]
    assert seen["ratio"] == pytest.approx(seen["scale0"], rel=1e-3)
    assert seen["unscaled_match"]
    assert seen["stepped"]
    assert seen["skipped"]
    assert seen["scale_after_overflow"] == seen["scale0"] / 2
    assert seen["fresh_scale"] == seen["scale0"]
    assert seen["loaded_scale"] == seen["scale0"] / 2


def precision_cases(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """bf16, then fp16, on this rank's group."""
    bf16 = {kind: _bf16(rank, kind) for kind in BF16_KINDS}
    return {"bf16": bf16, "fp16": _fp16(rank, world_size, folder)}


def check_precision(seen: dict[str, Any], world_size: int) -> None:
    _check_bf16(seen["bf16"], world_size)
    _check_fp16(seen["fp16"])


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


@pytest.mark.parametrize(
    ("precision", "fragment"),
    [("bf61", "did you mean 'bf16'"), ("bf16-mixed", "did you mean 'bf16'"), ("int8", "choose")],
)
def test_a_bad_precision_is_named_with_a_hint(
    world_of_one: ddpkit.Context, precision: object, fragment: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        ddpkit.wrap(_model(), precision=precision)  # type: ignore[arg-type]
    assert f"precision={precision!r}" in raised.value.message
    assert fragment in str(raised.value.hint)


def test_the_autocast_forward_survives_copies_and_replicas_and_keeps_the_state_dict(
    world_of_one: ddpkit.Context,
) -> None:
    model = ddpkit.wrap(_model(), precision="bf16")
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied[0].weight.zero_()  # the copy runs its own weights, not the original's
        assert not torch.equal(copied(torch.ones(2, 4)), model(torch.ones(2, 4)))
    # a DataParallel replica (torch's replicate copies the module's __dict__) runs itself too
    linear = ddpkit.wrap(nn.Linear(4, 1), precision="bf16")
    replica = linear._replicate_for_data_parallel()
    replica._parameters = {"weight": torch.zeros(1, 4), "bias": torch.zeros(1)}
    assert torch.equal(replica(torch.ones(2, 4)), torch.zeros(2, 1))
    assert isinstance(model, nn.Sequential)
    assert list(model.state_dict()) == list(_model().state_dict())
    assert model(torch.ones(2, 4)).dtype == torch.float32
