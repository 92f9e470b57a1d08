"""The fallback: one process on its own (``python train.py``), no launcher at all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ddpkit.cluster.environments.base import ClusterEnvironment
from ddpkit.cluster.envvars import parse_port
from ddpkit.cluster.rankinfo import ANY_PORT, Launcher, RankInfo

__all__ = ["SingleEnvironment", "single_rank_info"]

LOCALHOST = "127.0.0.1"


def single_rank_info(env: Mapping[str, str], notes: tuple[str, ...] = ()) -> RankInfo:
    """Rank 0 of a world of one (a SLURM batch script without srun too); MASTER_PORT when set,
    else ``ANY_PORT``: a world of one gets an in-process store, so it needs no port, and
    MASTER_ADDR is ignored."""
    raw_port = env.get("MASTER_PORT")
    port = None if raw_port is None else parse_port("MASTER_PORT", raw_port)
    return RankInfo(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr=LOCALHOST,
        master_port=ANY_PORT if port is None else port,
        launcher="single",
        notes=notes,
    )


class SingleEnvironment(ClusterEnvironment):
    """Always detected; last in the detection order."""

    launcher: ClassVar[Launcher] = "single"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return True

    def rank_info(self) -> RankInfo:
        return single_rank_info(self.env)
