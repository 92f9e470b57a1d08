"""Splitting a batch of any structure and putting it back: ddpkit.worker.structure, on CPU."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict
from typing import Any, NamedTuple

import pytest
import torch

from ddpkit.errors import ConfigError
from ddpkit.worker.structure import batch_rows, combine, concat, map_tensors, split, split_sizes


@pytest.mark.parametrize(
    ("total", "parts", "first", "expected"),
    [
        (10, 4, None, [3, 3, 3, 1]),  # torch's chunk rule: the 3/3/3/1
        (8, 4, None, [2, 2, 2, 2]),
        (2, 4, None, [1, 1, 0, 0]),  # a small last batch leaves devices idle, at the end
        (0, 3, None, [0, 0, 0]),
        (7, 1, None, [7]),
        (10, 4, 1, [1, 3, 3, 3]),  # gpu0_bsz-like: fewer on the output device
        (10, 3, 2, [2, 4, 4]),
        (3, 4, 8, [1, 1, 1, 0]),  # never more than the even share
        (10, 1, 2, [10]),
    ],
)
def test_split_sizes(total: int, parts: int, first: int | None, expected: list[int]) -> None:
    sizes = split_sizes(total, parts, first=first)
    assert sizes == expected and sum(sizes) == total


@pytest.mark.parametrize("first", [0, -1, 1.5, True, "2"])
def test_bad_first_device_batch_names_the_value(first: Any) -> None:
    with pytest.raises(ConfigError, match=f"first_device_batch={first!r} must be an int >= 1"):
        split_sizes(10, 2, first=first)


class Pair(NamedTuple):
    image: torch.Tensor
    label: str


@dataclasses.dataclass(frozen=True)
class Batch:
    pixels: torch.Tensor
    extras: dict[str, Any]
    note: str = "n"
    seen: int = dataclasses.field(default=0, init=False)


def _sample(rows: int) -> Any:
    x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    return {
        "tensor": x,
        "tuple": (x[:, 0], x * 2),
        "list": [x + 1, "leaf", 3],
        "ordered": OrderedDict(a=x, b=None),
        "default": defaultdict(list, {"k": x[:, 1]}),
        "named": Pair(x, "cat"),
        "data": Batch(x, {"mask": x > 3, "scale": torch.tensor(2.0)}),
        "scalar": torch.tensor(5.0),
    }


def test_split_then_concat_gives_the_batch_back() -> None:
    batch = _sample(10)
    parts = split(batch, [3, 3, 3, 1], rows=10)
    assert [batch_rows(part) for part in parts] == [3, 3, 3, 1]
    first = parts[0]
    assert torch.equal(first["tensor"], batch["tensor"][:3])
    assert type(first["named"]) is Pair and first["named"].label == "cat"
    assert type(first["data"]) is Batch and first["data"].pixels.shape == (
        3,
        2,
    )
    assert torch.equal(first["data"].extras["mask"], batch["data"].extras["mask"][:3])
    assert first["data"].extras["scale"] is batch["data"].extras["scale"]  # 0-dim: to every slice
    assert type(first["default"]) is defaultdict and first["default"].default_factory is list
    assert type(first["ordered"]) is OrderedDict and first["ordered"]["b"] is None
    assert first["list"][1:] == ["leaf", 3]
    back = concat(parts)
    for key in ("tensor", "ordered", "named", "default"):
        assert torch.equal(_first_tensor(back[key]), _first_tensor(batch[key])), key
    assert torch.equal(back["data"].pixels, batch["data"].pixels)
    assert back["data"].note == "n" and back["data"].seen == 0
    assert torch.equal(back["tuple"][1], batch["tuple"][1])
    assert back["list"][1:] == ["leaf", 3]
    assert back["scalar"].shape == (4,)  # 0-dim outputs are stacked, as torch's gather does


def _first_tensor(value: Any) -> torch.Tensor:
    found: list[torch.Tensor] = []
    map_tensors(value, lambda tensor: found.append(tensor) or tensor)
    return found[0]


def test_differing_leaves_are_listed_per_slice() -> None:
    assert concat([{"name": "a"}, {"name": "b"}]) == {"name": ["a", "b"]}


def test_a_tensor_of_other_rows_is_an_error_naming_where() -> None:
    batch = {"x": torch.zeros(10, 2), "pos": [torch.zeros(7)]}
    with pytest.raises(
        ConfigError, match=r"batch\['pos'\]\[0\] is a tensor of 7 rows in a batch of 10"
    ):
        split(batch, [5, 5], rows=10)


def test_slices_must_return_the_same_structure() -> None:
    with pytest.raises(TypeError, match="every slice must return the same structure"):
        concat([(torch.zeros(1),), [torch.zeros(1)]])


def test_combine_weights_scalars_by_slice_size() -> None:
    results = [
        (torch.tensor(1.0), {"acc": 0.5, "per_sample": torch.ones(3)}),
        (torch.tensor(4.0), {"acc": 1.0, "per_sample": torch.zeros(1)}),
    ]
    loss, metrics = combine(results, [3, 1], reduction="mean")
    assert loss.item() == pytest.approx((3 * 1.0 + 1 * 4.0) / 4)  # not the plain mean 2.5
    assert metrics["acc"] == pytest.approx(0.625)
    assert metrics["per_sample"].tolist() == [1.0, 1.0, 1.0, 0.0]
    total, _ = combine(results, [3, 1], reduction="sum")
    assert total.item() == 5.0
