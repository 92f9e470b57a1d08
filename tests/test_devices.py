"""Device choice per rank and the duplicate-GPU check: pure functions, table-driven."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddpkit.cluster.devices import check_distinct_gpus, choose_device, parse_visible_devices
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
]


@pytest.mark.parametrize(("local_rank", "lws", "cuda", "count", "visible", "expected"), CHOICES)
def test_choose_device(
    *, local_rank: int, lws: int, cuda: bool, count: int, visible: str | None, expected: str
) -> None:
    assert choose_device(local_rank, lws, cuda, count, visible) == expected


SHARED = [
    pytest.param(1, 2, True, 1, None, "LOCAL_WORLD_SIZE=2", "only 1 GPUs", "<unset>", id="unset"),
    pytest.param(3, 4, True, 2, "0,1", "LOCAL_WORLD_SIZE=4", "only 2 GPUs", "=0,1", id="two-of-4"),
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


def test_check_distinct_gpus_accepts_distinct_and_same_uuid_on_other_hosts() -> None:
    check_distinct_gpus([("a", "GPU-1"), ("a", "GPU-2"), ("b", "GPU-1"), ("b", "GPU-2")])
    check_distinct_gpus([])


def test_check_distinct_gpus_names_every_clash() -> None:
    identities = [("a", "GPU-1"), ("a", "GPU-2"), ("a", "GPU-1"), ("b", "GPU-2"), ("b", "GPU-2")]
    with pytest.raises(TopologyError) as caught:
        check_distinct_gpus(identities)
    message = str(caught.value)
    assert "ranks 0 and 2 on a share GPU GPU-1" in message
    assert "ranks 3 and 4 on b share GPU GPU-2" in message
    assert "ranks 1" not in message


def test_devices_module_does_not_import_torch() -> None:
    code = "import sys, ddpkit.cluster.devices; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"
