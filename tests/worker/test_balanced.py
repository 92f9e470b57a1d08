"""ddpkit.balanced_loss and the dp engine on CPU "devices" (threads sharing the one module).

The gradient a shared module accumulates from several threads is the sum that replicate's
broadcast backward gives on GPUs, so every device-independent part runs here for real: the
split of inputs, targets and keyword arguments, the threads and their state, the weighting.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.worker.dataparallel import DataParallel, ThreadState, run_parallel

CPU4 = ["cpu"] * 4  # 10 samples on 4 devices: 3/3/3/1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(rows: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 5, generator=generator), torch.randint(
        0, 3, (rows,), generator=generator
    )


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads


def _same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(first, second, strict=True)
    )


@pytest.mark.parametrize(
    "criterion",
    [
        nn.CrossEntropyLoss(),  # mean-reduced module
        nn.functional.cross_entropy,  # plain function, mean
        nn.CrossEntropyLoss(reduction="sum"),  # stays a sum ("auto" reads .reduction)
    ],
    ids=["module-mean", "function-mean", "module-sum"],
)
def test_equals_the_whole_batch_loss_with_gradients(criterion: Any) -> None:
    model, (x, y) = _model(), _data()
    whole = criterion(model(x), y)
    whole.backward()
    expected = _grads(model)
    loss = ddpkit.balanced_loss(model, criterion, devices=CPU4)(x, y)
    loss.backward()
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6)
    assert _same(_grads(model), expected)


def test_an_unweighted_mean_would_differ() -> None:
    """What PyTorch-Encoding and the HF Trainer compute on 3/3/3/1: the lone sample weighs 3x."""
    model, (x, y) = _model(), _data()
    whole = nn.functional.cross_entropy(model(x), y).item()
    unweighted = torch.stack(
        [
            nn.functional.cross_entropy(model(xs), ys)
            for xs, ys in zip(x.split(3), y.split(3), strict=True)
        ]
    ).mean()
    assert abs(unweighted.item() - whole) > 1e-3  # so the equality above is a real check


def test_uneven_split_several_outputs_kwargs_and_model_arguments() -> None:
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        aux: dict[str, torch.Tensor]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model()

        def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> Out:
            logits = self.body(x) * scale
            return Out(logits, {"norm": logits.pow(2).mean(1)})

    def criterion(out: Out, y: torch.Tensor, *, weight: torch.Tensor, alpha: float) -> Any:
        ce = nn.functional.cross_entropy(out.logits, y, reduction="none")
        return (ce * weight).mean() + alpha * out.aux["norm"].mean()

    net, (x, y) = Net(), _data()
    scale, weight = torch.linspace(0.5, 1.5, 10).unsqueeze(1), torch.linspace(1, 2, 10)
    whole = criterion(net(x, scale=scale), y, weight=weight, alpha=0.1)
    whole.backward()
    expected = _grads(net)
    step = ddpkit.balanced_loss(net, criterion, devices=CPU4, first_device_batch=1)  # 1/3/3/3
    loss = step(ddpkit.Args(x, scale=scale), y, weight=weight, alpha=0.1)
    loss.backward()
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6)
    assert _same(_grads(net), expected)


def test_metrics_are_weighted_and_per_sample_values_joined_in_order() -> None:
    model, (x, y) = _model(), _data()

    def criterion(logits: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        hits = (logits.argmax(1) == y).float()
        return {"loss": nn.functional.cross_entropy(logits, y), "acc": hits.mean(), "hits": hits}

    got = ddpkit.balanced_loss(model, criterion, devices=CPU4)(x, y)
    want = criterion(model(x), y)
    assert got["acc"].item() == pytest.approx(want["acc"].item())
    assert torch.equal(got["hits"], want["hits"])
    per_sample = ddpkit.balanced_loss(model, nn.CrossEntropyLoss(reduction="none"), devices=CPU4)
    assert torch.allclose(
        per_sample(x, y), nn.functional.cross_entropy(model(x), y, reduction="none")
    )


def test_without_dataparallel_it_is_the_plain_call() -> None:
    model, (x, y) = _model(), _data()
    seen: list[tuple[Any, ...]] = []

    def criterion(out: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.append((out.shape, target is y, kwargs, threading.current_thread()))
        return out.sum()

    ddpkit.balanced_loss(model, criterion)(x, y, tag=1)
    assert seen == [((10, 3), True, {"tag": 1}, threading.main_thread())]


def test_grad_mode_inference_mode_and_autocast_dtype_reach_every_thread() -> None:
    def seen(_: int) -> tuple[bool, bool, torch.dtype]:
        out = nn.Linear(3, 3)(torch.randn(2, 3))
        return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), out.dtype

    devices = [torch.device("cpu")] * 3
    with torch.no_grad():
        assert run_parallel(seen, devices) == [(False, False, torch.float32)] * 3
    with torch.inference_mode():
        assert run_parallel(seen, devices) == [(False, True, torch.float32)] * 3
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            assert run_parallel(seen, devices) == [(True, False, dtype)] * 3


def test_torch_s_thread_pattern_loses_the_autocast_dtype() -> None:
    """torch's parallel_apply re-enters ``autocast(device_type, enabled=...)`` in its threads:
    the dtype falls back to the default (here fp16 becomes CPU's default bf16; on CUDA bf16
    becomes fp16). ThreadState carries the dtype."""
    dtypes: dict[str, torch.dtype] = {}

    def worker(state: ThreadState, enabled: bool) -> None:
        with torch.amp.autocast("cpu", enabled=enabled):
            dtypes["torch"] = nn.Linear(3, 3)(torch.randn(2, 3)).dtype
        with state.applied():
            dtypes["ddpkit"] = nn.Linear(3, 3)(torch.randn(2, 3)).dtype

    with torch.autocast("cpu", dtype=torch.float16):
        args = (ThreadState.capture(), torch.is_autocast_enabled("cpu"))
        thread = threading.Thread(target=worker, args=args)
        thread.start()
        thread.join()
    assert dtypes == {"torch": torch.bfloat16, "ddpkit": torch.float16}


def test_an_error_in_a_slice_is_raised_naming_it() -> None:
    def fail_on_two(index: int) -> int:
        if index == 2:
            raise ValueError("bad slice")
        return index

    with pytest.raises(ValueError, match="bad slice") as caught:
        run_parallel(fail_on_two, [torch.device("cpu")] * 3)
    assert "(in slice 2 of 3, on cpu)" in caught.value.__notes__


def test_dataparallel_steps_split_and_rebuild_dataclasses() -> None:
    """ddpkit's DataParallel scatter/parallel_apply/gather on CPU devices (torch's scatter
    passes a dataclass whole to every device, its gather fails on one)."""

    @dataclasses.dataclass
    class Item:
        x: torch.Tensor
        tag: str

    class Echo(nn.Module):
        def forward(self, item: Item) -> Item:
            return Item(item.x * 2, item.tag)

    wrapper = DataParallel(Echo(), first_device_batch=1)
    devices = [torch.device("cpu")] * 3
    wrapper.device_ids = devices  # no GPU here: name CPU devices for the three steps
    inputs, kwargs = wrapper.scatter((Item(torch.arange(7.0), "t"),), {}, devices)
    assert [part[0].x.tolist() for part in inputs] == [[0.0], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    outputs = wrapper.parallel_apply([wrapper.module] * 3, inputs, kwargs)
    back = wrapper.gather(outputs, torch.device("cpu"))
    assert isinstance(back, Item) and back.tag == "t" and back.x.tolist() == list(range(0, 14, 2))


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="reduction='avg'"):
        ddpkit.balanced_loss(_model(), nn.CrossEntropyLoss(), reduction="avg")
    with pytest.raises(ConfigError, match="criterion=3 is not callable"):
        ddpkit.balanced_loss(_model(), 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="first_device_batch=0"):
        ddpkit.balanced_loss(_model(), nn.MSELoss(), devices=CPU4, first_device_batch=0)
