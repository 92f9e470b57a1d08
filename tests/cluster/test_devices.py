"""Device choice per rank and the duplicate-GPU check: pure functions, table-driven."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddpkit.cluster.devices import (
    check_distinct_gpus,
    choose_device,
    owned_devices,
    parse_visible_devices,
)
from ddpkit.errors import TopologyError

# (local_rank, local_world_size, cuda_available, device_count, CUDA_VISIBLE_DEVICES) -> device
CHOICES = [
    pytest.param(0, 1, False, 0, None, "cpu", id="no-cuda"),
    pytest.param(3, 4, False, 8, "0,1", "cpu", id="cuda-unavailable-ignores-count"),
    pytest.param(0, 1, True, 0, "", "cpu", id="cuda-but-no-device"),
    pytest.param(0, 1, True, 1, None, "cuda:0", id="one-rank-one-gpu"),
    pytest.param(2, 4, True, 4, None, "cuda:2", id="one-gpu-per-rank"),
    pytest.param(1, 2, True, 8, None, "cuda:1", id="more-gpus-than-ranks"),
    pytest.param(3, 4, True, 4, "4,5,6,7", "cuda:3", id="visible-subset-indexes-from-0"),
    pytest.param(3, 4, True, 1, "GPU-3", "cuda:0", id="isolated-one-gpu-per-task"),
    pytest.param(0, 8, True, 1, "5", "cuda:0", id="isolated-rank-0"),
    pytest.param(0, 1, True, 1, "7", "cuda:0", id="single-task-single-visible"),
    # --gpus-per-task=2 with 4 tasks on a node: each task sees its own 2 GPUs and computes on
    # its first (a model split across both under DDP); every local rank gets cuda:0
    pytest.param(0, 4, True, 2, "0,1", "cuda:0", id="two-own-gpus-rank-0"),
    pytest.param(3, 4, True, 2, "6,7", "cuda:0", id="two-own-gpus-rank-3"),
    pytest.param(1, 4, True, 2, "GPU-a,GPU-b", "cuda:0", id="two-own-gpus-by-uuid"),
    pytest.param(2, 3, True, 2, "0,1", "cuda:0", id="two-own-gpus-3-tasks"),
    pytest.param(5, 8, True, 3, "3,4,5", "cuda:0", id="three-own-gpus"),
]


@pytest.mark.parametrize(("local_rank", "lws", "cuda", "count", "visible", "expected"), CHOICES)
def test_choose_device(
    *, local_rank: int, lws: int, cuda: bool, count: int, visible: str | None, expected: str
) -> None:
    assert choose_device(local_rank, lws, cuda, count, visible) == expected


SHARED = [
    pytest.param(1, 2, True, 1, None, "LOCAL_WORLD_SIZE=2", "only 1 GPUs", "<unset>", id="unset"),
    pytest.param(3, 4, True, 2, "0,1,2", "LOCAL_WORLD_SIZE=4", "only 2 GPUs", "=0,1,2", id="3-2"),
    pytest.param(3, 4, True, 2, "", "LOCAL_WORLD_SIZE=4", "only 2 GPUs", "=", id="empty-list"),
    pytest.param(0, 8, True, 4, None, "LOCAL_WORLD_SIZE=8", "only 4 GPUs", "<unset>", id="half"),
]


@pytest.mark.parametrize(("local_rank", "lws", "cuda", "count", "visible", "a", "b", "c"), SHARED)
def test_choose_device_refuses_shared_gpu(
    *,
    local_rank: int,
    lws: int,
    cuda: bool,
    count: int,
    visible: str | None,
    a: str,
    b: str,
    c: str,
) -> None:
    with pytest.raises(TopologyError) as caught:
        choose_device(local_rank, lws, cuda, count, visible)
    message = str(caught.value)
    for part in (a, b, f"CUDA_VISIBLE_DEVICES{c}" if c.startswith("=") else c):
        assert part in message
    assert "two ranks would share a GPU" in message
    assert caught.value.hint is not None and "--gpus-per-task" in caught.value.hint


@pytest.mark.parametrize(("local_rank", "lws"), [(2, 2), (-1, 2), (0, 0)])
def test_choose_device_rejects_local_rank_out_of_range(local_rank: int, lws: int) -> None:
    with pytest.raises(TopologyError, match=f"LOCAL_RANK={local_rank} is outside"):
        choose_device(local_rank, lws, True, 8, None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [(None, None), ("", []), ("0", ["0"]), ("0, 2,3", ["0", "2", "3"]), ("GPU-ab,", ["GPU-ab"])],
)
def test_parse_visible_devices(text: str | None, expected: list[str] | None) -> None:
    assert parse_visible_devices(text) == expected


# (chosen index, local_world_size, device_count, CUDA_VISIBLE_DEVICES) -> indexes the rank uses
OWNED = [
    pytest.param(2, 4, 4, None, [2], id="one-gpu-per-rank"),
    pytest.param(1, 2, 8, "0,1,2,3,4,5,6,7", [1], id="more-gpus-than-ranks"),
    pytest.param(0, 4, 1, "3", [0], id="own-one-gpu"),
    pytest.param(0, 4, 2, "2,3", [0, 1], id="own-two-gpus"),
    pytest.param(0, 8, 3, "GPU-a,GPU-b,GPU-c", [0, 1, 2], id="own-three-gpus"),
]


@pytest.mark.parametrize(("chosen", "lws", "count", "visible", "expected"), OWNED)
def test_owned_devices(
    chosen: int, lws: int, count: int, visible: str | None, expected: list[int]
) -> None:
    assert owned_devices(chosen, lws, count, visible) == expected


def test_check_distinct_gpus_accepts_distinct_and_same_uuid_on_other_hosts() -> None:
    check_distinct_gpus([("a", ["GPU-1"]), ("a", ["GPU-2"]), ("b", ["GPU-1"]), ("b", ["GPU-2"])])
    # --gpus-per-task=2: each rank owns two GPUs, disjoint across the ranks of a node
    check_distinct_gpus([("a", ["G0", "G1"]), ("a", ["G2", "G3"]), ("b", ["G0", "G1"])])
    check_distinct_gpus([])


def test_check_distinct_gpus_names_every_clash() -> None:
    identities = [("a", ["GPU-1"]), ("a", ["GPU-2"]), ("a", ["GPU-1"])]
    identities += [("b", ["GPU-2"]), ("b", ["GPU-2"])]
    with pytest.raises(TopologyError) as caught:
        check_distinct_gpus(identities)
    message = str(caught.value)
    assert "ranks 0 and 2 on a share GPU GPU-1" in message
    assert "ranks 3 and 4 on b share GPU GPU-2" in message
    assert "ranks 1" not in message


@pytest.mark.parametrize(
    ("identities", "clash"),
    [
        # a node-wide CUDA_VISIBLE_DEVICES=0,1 given to 4 ranks looks like 2 GPUs per task to
        # each rank (all choose cuda:0): the ranks' uuids show they are the same two GPUs
        ([("a", ["G0", "G1"])] * 4, "ranks 0 and 1 on a share GPU G0"),
        # overlapping sets: the first GPUs differ, the second of rank 0 is rank 1's first
        ([("a", ["G0", "G1"]), ("a", ["G1", "G2"])], "ranks 0 and 1 on a share GPU G1"),
    ],
)
def test_check_distinct_gpus_rejects_several_gpus_shared(
    identities: list[tuple[str, list[str]]], clash: str
) -> None:
    with pytest.raises(TopologyError, match=clash):
        check_distinct_gpus(identities)


def test_devices_module_does_not_import_torch() -> None:
    code = "import sys, ddpkit.cluster.devices; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"
