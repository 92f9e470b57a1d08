"""wrap's decisions for dp without GPUs and for models split across devices (pure, on CPU)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.worker.placement import Placement, plan_placement


@pytest.fixture
def world_of_one() -> Iterator[ddpkit.Context]:
    yield ddpkit.init(env={})
    ddpkit.shutdown()


@pytest.mark.parametrize(
    ("devices", "requested", "chosen", "expected"),
    [
        ({"cpu"}, "auto", "single", Placement("single", move=True)),
        ({"cuda:1"}, "ddp", "ddp", Placement("ddp", move=True)),
        (set(), "dp", "dp", Placement("dp", move=True)),  # no parameters at all
        ({"cpu", "meta"}, "auto", "single", Placement("single", move=False)),  # cannot move
        ({"cpu", "cuda:0"}, "single", "single", Placement("single", move=False)),
        ({"cpu", "cuda:0"}, "auto", "single", Placement("single", move=False)),
        ({"cuda:0", "cuda:1"}, "auto", "dp", Placement("single", move=False)),
        ({"cuda:0", "cuda:1"}, "auto", "ddp", Placement("ddp", False, ddp_device_ids=None)),
        ({"cuda:2", "cuda:3"}, "ddp", "ddp", Placement("ddp", False, ddp_device_ids=None)),
    ],
)
def test_placement_table(
    devices: set[str], requested: str, chosen: str, expected: Placement
) -> None:
    assert plan_placement(devices, requested=requested, chosen=chosen) == expected


@pytest.mark.parametrize(
    ("devices", "requested", "chosen", "options", "expected"),
    [
        (
            {"cpu", "cuda:0"},
            "auto",
            "ddp",
            (),
            (
                "strategy='auto' resolved to DDP for a model split across cpu, cuda:0",
                "gpus_per_task",
            ),
        ),
        (
            {"cuda:0", "cuda:1"},
            "dp",
            "dp",
            (),
            ("strategy='dp' with a model split across cuda:0, cuda:1", "strategy='single'"),
        ),
        (
            {"cuda:0", "cuda:1"},
            "ddp",
            "ddp",
            ("device_ids",),
            ("device_ids given for a model split across cuda:0, cuda:1", "drop device_ids"),
        ),
    ],
)
def test_placements_torch_refuses_are_one_line_errors(
    devices: set[str],
    requested: str,
    chosen: str,
    options: tuple[str, ...],
    expected: tuple[str, str],
) -> None:
    message, hint = expected
    with pytest.raises(ConfigError) as caught:
        plan_placement(devices, requested=requested, chosen=chosen, ddp_options=options)
    assert message in caught.value.message and "\n" not in str(caught.value)
    assert caught.value.hint is not None and hint in caught.value.hint


def test_dp_without_gpus_is_single_with_one_warning(world_of_one: ddpkit.Context) -> None:
    model = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = ddpkit.wrap(model, "dp", first_device_batch=4)
    assert wrapped is model
    assert [str(w.message) for w in caught] == [
        "strategy='dp' on cpu without GPUs: running as 'single' (the same script uses "
        "DataParallel where several GPUs are visible)"
    ]
    with pytest.raises(ConfigError, match="first_device_batch=0"):
        ddpkit.wrap(model, first_device_batch=0)


def test_a_model_with_parts_on_two_devices_is_not_moved(world_of_one: ddpkit.Context) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    assert ddpkit.wrap(model) is model
