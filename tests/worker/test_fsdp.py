"""wrap(model, "fsdp"): which blocks FSDP2 shards, its options' errors, and real sharded training
on gloo (world sizes 1, 2 and 3) that follows the single-process trajectory (run in the launch of
tests/worker/test_loop_ranks.py that the loop's other features share)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.worker.fsdp import choose_blocks
from tests.support import tinymlp


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = tinymlp.Block(4)  # nested inside a named block: not a unit of its own
        self.other = nn.Linear(4, 4)


def test_named_blocks_are_the_outermost_instances() -> None:
    model = nn.Sequential(Pair(), tinymlp.Block(4), nn.Sequential(tinymlp.Block(4)))
    chosen = choose_blocks(model, (Pair, tinymlp.Block))
    assert chosen == [model[0], model[1], model[2][0]]


def test_the_size_rule_takes_modules_of_an_eighth_bottom_up() -> None:
    # 6 blocks of 72 parameters and a head of 9: each block is over 1/8 of 441
    body = [tinymlp.Block(8) for _ in range(6)]
    model = nn.Sequential(nn.Sequential(*body), nn.Linear(8, 1))
    assert choose_blocks(model, None) == body  # the Sequential holding them has nothing left
    # a few large layers and many small ones: the small ones add up within their parent
    small = nn.Sequential(*(nn.Linear(2, 2) for _ in range(12)))  # 72 of 504
    model = nn.Sequential(nn.Linear(8, 24), small, nn.Linear(8, 24))
    assert choose_blocks(model, None) == [model[0], small, model[2]]
    # one layer only: no block, the root is the one unit
    assert choose_blocks(nn.Linear(3, 3), None) == []


@pytest.mark.parametrize(
    ("options", "fragment", "hint"),
    [
        (
            {"fsdp_blocks": "Block"},
            "fsdp_blocks='Block' must be",
            "fsdp_blocks=(TransformerBlock,)",
        ),
        ({"fsdp_blocks": (nn.Linear(2, 2),)}, "is not an nn.Module class", "the class itself"),
        ({"fsdp_blocks": ()}, "fsdp_blocks=() names no class", "None for the size rule"),
        ({"fsdp_blocks": (nn.Conv1d,)}, "(Conv1d,) matches no submodule", "print(model)"),
        ({"precision": "bf61"}, "precision='bf61'", "did you mean 'bf16'?"),
        ({"precision": "fp8"}, "precision='fp8'", "choices: 'bf16', None"),
        ({"precision": "fp16"}, "precision='fp16' with strategy='fsdp'", "precision='bf16'"),
        ({"compile": {"mdoe": "default"}}, "{'mdoe': ...} is not a torch.compile", "'mode'"),
    ],
)
def test_bad_fsdp_options_name_the_value_and_a_hint(
    world_of_one: ddpkit.Context, options: dict[str, Any], fragment: str, hint: str
) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ConfigError) as caught:
        ddpkit.wrap(model, "fsdp", **options)
    assert fragment in caught.value.message
    assert caught.value.hint is not None and hint in caught.value.hint
    assert not isinstance(model, FSDPModule)  # refused before anything was sharded


def test_fsdp_options_with_another_strategy_are_an_error(world_of_one: ddpkit.Context) -> None:
    for strategy in ("auto", "single", "ddp"):
        with pytest.raises(ConfigError, match=r"fsdp_blocks=.* given, but") as caught:
            ddpkit.wrap(nn.Linear(2, 2), strategy, fsdp_blocks=(nn.Linear,))
        assert caught.value.hint is not None and "strategy='fsdp'" in caught.value.hint
    with pytest.raises(ConfigError, match="static_graph"):
        ddpkit.wrap(nn.Linear(2, 2), "fsdp", static_graph=True)
    with pytest.raises(ConfigError, match="sync_batchnorm=True with strategy='fsdp'"):
        ddpkit.wrap(nn.Linear(2, 2), "fsdp", sync_batchnorm=True)


def fsdp_case(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """FSDP2 training ``steps`` steps on this rank's group, and a bf16 model's forward."""
    model = ddpkit.wrap(tinymlp.make_model(), "fsdp", fsdp_blocks=(tinymlp.Block,))
    with pytest.raises(ConfigError, match="already wrapped"):
        ddpkit.wrap(model, "fsdp")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = [tinymlp.step(model, optimizer, rank, world_size) for _ in range(steps)]
    units = [type(module).__name__ for module in model.modules() if isinstance(module, FSDPModule)]
    local = sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor))
    bf16 = ddpkit.wrap(tinymlp.make_model(), "fsdp", precision="bf16")
    kept = {p.dtype for p in bf16.parameters()}
    out = bf16(torch.randn(3, 4))
    return {
        "losses": losses,
        "units": units,
        "local": local,
        "bf16": (out.dtype, kept),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
    }


def check_fsdp(results: list[dict[str, Any]], world_size: int, steps: int) -> None:
    """FSDP2 trains on the single-process trajectory, every parameter sharded once."""
    expected = tinymlp.reference(steps)
    total = sum(p.numel() for p in tinymlp.make_model().parameters())
    for seen in results:
        assert seen["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
        assert seen["sharded"]
        # the two blocks and the root
        assert seen["units"] == ["FSDPSequential", "FSDPBlock", "FSDPBlock"]
        assert seen["bf16"] == (torch.bfloat16, {torch.float32})  # computes in bf16, keeps fp32
    assert sum(seen["local"] for seen in results) == total  # every parameter once
    assert max(seen["local"] for seen in results) <= total / world_size + 16
