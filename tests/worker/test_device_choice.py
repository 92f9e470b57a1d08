"""``ddpkit.init(device=...)``: a bare ``"cuda"`` means this rank's GPU (found on an H100: it
crashed in ``torch.cuda.set_device("cuda")``); an explicit device is kept as given."""

from __future__ import annotations

import pytest
import torch

from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.errors import ConfigError
from ddpkit.worker import context


def info(local_rank: int, local_world_size: int) -> RankInfo:
    return RankInfo(
        rank=local_rank, world_size=local_world_size, local_rank=local_rank,
        local_world_size=local_world_size, node_rank=0, num_nodes=1,
        master_addr="127.0.0.1", master_port=29500, launcher="torchrun",
    )  # fmt: skip


def gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """A fake CUDA runtime with ``count`` GPUs: the corner no CPU machine has on demand."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize("local_rank", [0, 1, 3])
@pytest.mark.parametrize("override", ["cuda", torch.device("cuda")])
def test_bare_cuda_is_this_ranks_gpu(monkeypatch, local_rank, override):
    gpus(monkeypatch, 4)
    chosen = context._pick_device(info(local_rank, 4), override)
    assert chosen == torch.device(f"cuda:{local_rank}")


@pytest.mark.parametrize("override", ["cuda:2", "cpu", torch.device("cuda", 1)])
def test_an_explicit_device_is_kept(monkeypatch, override):
    gpus(monkeypatch, 4)
    assert context._pick_device(info(0, 4), override) == torch.device(override)


def test_bare_cuda_without_a_gpu_is_a_one_line_error(monkeypatch):
    gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match=r"device='cuda' but this process sees no CUDA GPU"):
        context._pick_device(info(0, 1), "cuda")


def test_no_override_is_the_automatic_choice(monkeypatch):
    gpus(monkeypatch, 2)
    assert context._pick_device(info(1, 2), None) == torch.device("cuda:1")
    gpus(monkeypatch, 0)
    assert context._pick_device(info(1, 2), None) == torch.device("cpu")
