"""``wrap(model, compile=...)``: compiled, then wrapped in DDP, on a real gloo group of 2 ranks.

Compiling is the point here, not the kernels: the tests use torch.compile's ``aot_eager``
backend (dynamo's graphs and AOTAutograd's forward/backward split, without inductor's C++
compiles, which cost minutes of CPU). A model with BatchNorm, trained through
``ddpkit.accumulate`` windows (DDP's ``no_sync`` under the compiled module), gives the losses
and running statistics of eager DDP, with and without ``static_graph``; its checkpoint holds
the keys of the uncompiled model. A backend that counts graphs shows DDPOptimizer splitting the
model at DDP's buckets (the reason for the order) under ``fullgraph=True``. FSDP2 with its
blocks compiled (each block's forward run by the compiled graph) follows the single process's
eager trajectory, its keys unchanged. The cases share one launch of 2 ranks (each rank imports
dynamo once), one after the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.errors import ConfigError
from tests.support import tinymlp
from tests.support.distutil import run_workers, torchrun_env

MICRO_STEPS, EVERY = 6, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def _train(model: nn.Module, rank: int, every: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(MICRO_STEPS):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 1, generator=generator)
        with ddpkit.accumulate(model, every=every) as micro:
            loss = F.mse_loss(model(x), y)
            loss.backward()
        losses.append(float(loss))
        if micro.sync:
            optimizer.step()
            optimizer.zero_grad()
    return losses


def _trajectory(rank: int, ddp_kwargs: dict[str, Any], every: int, folder: Path) -> dict[str, Any]:
    """Eager and compiled DDP trained alike; the compiled one's checkpoint, saved and loaded."""
    eager = ddpkit.wrap(_model(), "ddp", **ddp_kwargs)
    compiled = ddpkit.wrap(_model(), "ddp", compile={"backend": "aot_eager"}, **ddp_kwargs)
    seen: dict[str, Any] = {"eager": _train(eager, rank, every)}
    seen["compiled"] = _train(compiled, rank, every)
    for name, model in (("eager_bn", eager), ("compiled_bn", compiled)):
        seen[name] = ddpkit.unwrap(model)[1].running_mean.tolist()
    seen["compiled_type"] = f"{type(compiled).__name__}({type(compiled.module).__name__})"
    ddpkit.save_checkpoint(folder, {"model": compiled}, step=MICRO_STEPS)
    raw: dict[str, Any] = {"model": None}  # no module to load into: the saved state dict
    ddpkit.load_checkpoint(folder, raw)
    seen["saved_keys"] = list(raw["model"])
    seen["eager_keys"] = list(ddpkit.unwrap(eager).state_dict())
    fresh = _model()
    ddpkit.load_checkpoint(folder, {"model": fresh})
    seen["loaded"] = [
        key
        for (key, a), b in zip(
            fresh.state_dict().items(), compiled.state_dict().values(), strict=True
        )
        if not torch.equal(a, b)
    ]
    return seen


def _graphs() -> dict[str, int]:
    """The graphs a counting backend is given for a model under DDP and for one alone."""
    counts = {"ddp": 0, "alone": 0}

    def counting(where: str) -> Any:
        def backend(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
            counts[where] += 1
            return graph.forward

        return backend

    def big() -> nn.Module:  # 1 MiB a layer: DDP buckets of 1 MB hold one layer each
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh())

    options = {"backend": counting("ddp"), "fullgraph": True}
    model = ddpkit.wrap(big(), "ddp", compile=options, bucket_cap_mb=1)
    alone = torch.compile(big(), backend=counting("alone"), fullgraph=True)
    for net in (model, alone):
        net(torch.randn(3, 512)).sum().backward()
    return counts


FSDP_STEPS = 3


def _fsdp(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 with its blocks compiled (a backend that counts the runs of the graphs it
    compiled): the losses, the runs, and the state dict's keys."""
    runs = [0]

    def counting(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        def run(*args: Any) -> Any:
            runs[0] += 1
            return graph.forward(*args)

        return run

    options = {"backend": counting}
    model = ddpkit.wrap(tinymlp.make_model(), "fsdp", fsdp_blocks=(tinymlp.Block,), compile=options)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = [tinymlp.step(model, optimizer, rank, world_size) for _ in range(FSDP_STEPS)]
    return {"losses": losses, "runs": runs[0], "keys": list(model.state_dict())}


def _check_fsdp(seen: dict[str, Any], where: str) -> None:
    """Compiled FSDP2 blocks train on the single process's eager trajectory, keys unchanged."""
    assert seen["losses"] == pytest.approx(tinymlp.reference(FSDP_STEPS), rel=1e-5), where
    assert seen["runs"] == 2 * FSDP_STEPS, where  # each block's forward ran compiled
    assert seen["keys"] == list(tinymlp.make_model().state_dict()), where  # no _orig_mod.


def _small_buckets() -> str:
    try:
        ddpkit.wrap(_model(), "ddp", compile=True, bucket_cap_mb=0.5)
    except ConfigError as error:
        return error.message
    return "no error"


# static_graph: torch asserts when DDP's first backward skips the sync (in eager too);
# ddpkit.accumulate syncs that one micro-step
CASES = {"accumulated": ({}, EVERY), "static_graph": ({"static_graph": True}, EVERY)}


def _compile_worker(rank: int, world_size: int, port: int, root: str) -> dict[str, Any]:
    """Every case, one after the other, on one group of 2 (one launch, not one a case); dynamo's
    caches are reset between them, so that no case runs on another's graphs."""
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    try:
        seen: dict[str, Any] = {"small_buckets": _small_buckets()}
        for name, (ddp_kwargs, every) in CASES.items():
            torch._dynamo.reset()
            seen[name] = _trajectory(rank, ddp_kwargs, every, Path(root) / name)
        torch._dynamo.reset()
        seen["graphs"] = _graphs()
        torch._dynamo.reset()
        seen["fsdp"] = _fsdp(rank, world_size)
        return seen
    finally:
        ddpkit.shutdown()


@pytest.mark.multiproc
def test_compiled_ddp_trains_as_eager_splits_at_buckets_refuses_smaller(tmp_path: Path) -> None:
    """Trains as eager and saves its keys (with and without static_graph), DDPOptimizer splits
    the compiled graph at the buckets, buckets under the first are refused with compile."""
    for rank, by_case in enumerate(run_workers(_compile_worker, 2, str(tmp_path))):
        for name in CASES:
            _check_trajectory(rank, by_case[name], f"{name}, rank {rank}")
        _check_graphs(by_case["graphs"], f"rank {rank}")
        _check_fsdp(by_case["fsdp"], f"fsdp, rank {rank}")
        assert "bucket_cap_mb=0.5 with compile" in by_case["small_buckets"], rank


def _check_trajectory(rank: int, seen: dict[str, Any], where: str) -> None:
    """Compiled DDP trains as eager and saves its keys."""
    assert seen["compiled_type"] == "DistributedDataParallel(OptimizedModule)", where
    assert seen["compiled"] == pytest.approx(seen["eager"], rel=1e-5, abs=1e-6), where
    assert seen["compiled_bn"] == pytest.approx(seen["eager_bn"], rel=1e-5, abs=1e-6), where
    # rank 0's state is saved; BatchNorm's statistics are each rank's own until DDP's
    # next forward broadcasts rank 0's (broadcast_buffers), in eager as compiled
    assert seen["loaded"] == ([] if rank == 0 else ["1.running_mean", "1.running_var"]), where
    assert seen["saved_keys"] == seen["eager_keys"], where  # no module. / _orig_mod.
    assert not any("_orig_mod" in key for key in seen["saved_keys"]), where


def _check_graphs(counts: dict[str, int], where: str) -> None:
    """DDPOptimizer splits the compiled graph at the buckets."""
    assert counts["alone"] == 1, where  # one graph for the model alone (fullgraph holds)
    assert counts["ddp"] >= 2, where  # DDPOptimizer split it at DDP's bucket boundaries


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


@pytest.mark.parametrize(
    ("value", "fragment"),
    [({"fullgrap": True}, "did you mean 'fullgraph'"), ("yes", "must be True, False or a dict")],
)
def test_a_bad_compile_option_is_named(
    world_of_one: ddpkit.Context, value: object, fragment: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        ddpkit.wrap(_model(), compile=value)  # type: ignore[arg-type]
    assert fragment in f"{raised.value.message} {raised.value.hint}"


def test_compile_single_keeps_the_state_dict_keys(world_of_one: ddpkit.Context) -> None:
    model = ddpkit.wrap(_model(), compile={"backend": "eager"})
    assert ddpkit.unwrap(model) is not model  # torch's wrapper around it
    keys = list(ddpkit.clean_state_dict(model.state_dict()))
    assert keys == list(_model().state_dict())
