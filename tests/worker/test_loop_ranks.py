"""The training loop's features on real gloo groups of 1, 2 and 3 ranks, one launch per world size.

Each rank checks, one after the other on the same group: ``ddpkit.accumulate`` on DDP, FSDP2,
DataParallel and a plain model (tests/worker/test_accumulate.py), ``ddpkit.clip_grad_norm_`` on
DDP, FSDP2, DataParallel and a plain model (tests/worker/test_clip.py), FSDP2 training on the
single-process trajectory (tests/worker/test_fsdp.py), bf16 on DDP, DataParallel and a plain
model and the fp16 scaler under DDP (tests/worker/test_precision.py). Those files hold each
case's code and checks; sharing a launch, a forked rank imports dynamo (what the first DDP or
optimizer costs) once for them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import ddpkit
from tests.support.distutil import run_workers, torchrun_env
from tests.worker.test_accumulate import accumulate_cases, check_accumulate
from tests.worker.test_clip import check_clip, clip_cases
from tests.worker.test_fsdp import check_fsdp, fsdp_case
from tests.worker.test_precision import check_precision, precision_cases

FSDP_STEPS = 4


def _loop_worker(rank: int, world_size: int, port: int, folder: str) -> dict[str, Any]:
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    try:
        seen = {"accumulate": accumulate_cases(world_size), "clip": clip_cases(world_size)}
        seen["fsdp"] = fsdp_case(rank, world_size, FSDP_STEPS)
        seen["precision"] = precision_cases(rank, world_size, folder)
        dist.barrier()
        return seen
    finally:
        ddpkit.shutdown()


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_accumulate_clip_fsdp_and_precision_on_one_group(world_size: int, tmp_path: Path) -> None:
    results = run_workers(_loop_worker, world_size, str(tmp_path))
    for rank, seen in enumerate(results):
        check_accumulate(seen["accumulate"], rank, world_size)
        check_clip(seen["clip"], rank, world_size)
        check_precision(seen["precision"], world_size)
    check_fsdp([seen["fsdp"] for seen in results], world_size, FSDP_STEPS)
