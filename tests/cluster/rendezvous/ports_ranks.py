"""The ranks of tests/cluster/rendezvous/test_ports.py's port search, and the step they run in.

A module of their own, without pytest: ``run_workers``' fork server (torch preloaded) imports
the module of the function it runs in every rank it forks, and a test module brings pytest
with it (~0.25 CPU-s a rank on the test machine). The assertions stay in test_ports.py.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import ddpkit
from tests.support.distutil import slurm_step_env


def slurm_env(rank: int, world_size: int, job_id: str, **extra: str) -> dict[str, str]:
    """A one-node srun step as SLURM describes it; MASTER_ADDR because tests run on 127.0.0.1."""
    return slurm_step_env(rank, world_size, job_id, "n1", MASTER_ADDR="127.0.0.1", **extra)


def slurm_worker(
    rank: int, world_size: int, _port: int, job_id: str, delay_s: float
) -> dict[str, Any]:
    if rank == 0:
        time.sleep(delay_s)  # the others search before rank 0 has bound anything
    ctx = ddpkit.init(env=slurm_env(rank, world_size, job_id), connect_timeout_s=60)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    port = ctx.info.master_port
    ddpkit.shutdown()
    return {"rank": ctx.rank, "port": port, "sum": total.item()}
