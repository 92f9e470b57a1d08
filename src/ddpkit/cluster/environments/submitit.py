"""Jobs started by submitit: its SLURM executor (srun tasks) and its local executor.

submitit's SLURM jobs are SLURM steps, so their rank arithmetic is SLURM's
(:func:`~ddpkit.cluster.environments.slurm.slurm_rank_info`), only labelled "submitit". The
local executor starts ``tasks_per_node`` processes on this machine and describes them with its
own ``SUBMITIT_LOCAL_*`` variables (``submitit/local/local.py``: ``LocalJobEnvironment._env``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ddpkit.cluster import validate
from ddpkit.cluster.environments.base import ClusterEnvironment
from ddpkit.cluster.environments.slurm import SlurmEnvironment, slurm_rank_info
from ddpkit.cluster.envvars import master_from_env, require_int
from ddpkit.cluster.rankinfo import Launcher, RankInfo
from ddpkit.cluster.rendezvous.ports import port_for_job
from ddpkit.errors import ConfigError

__all__ = ["SubmititEnvironment"]

_EXECUTOR = "SUBMITIT_EXECUTOR"
_HINT = "submitit's local executor sets this for every task; submit the job through submitit"


class SubmititEnvironment(ClusterEnvironment):
    """Detected by SUBMITIT_EXECUTOR: ``slurm`` (with SLURM's task variables) or ``local``."""

    launcher: ClassVar[Launcher] = "submitit"
    # The local executor's variables, named as in submitit's LocalJobEnvironment.
    _VARS: ClassVar[dict[str, str]] = {
        "job_id": "SUBMITIT_LOCAL_JOB_ID",
        "world_size": "SUBMITIT_LOCAL_NTASKS",
        "num_nodes": "SUBMITIT_LOCAL_JOB_NUM_NODES",
        "node_rank": "SUBMITIT_LOCAL_NODEID",
        "rank": "SUBMITIT_LOCAL_GLOBALID",
        "local_rank": "SUBMITIT_LOCAL_LOCALID",
    }

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        executor = env.get(_EXECUTOR)
        if executor == "slurm":
            return SlurmEnvironment.detect(env)
        return executor == "local"

    def rank_info(self) -> RankInfo:
        if self.env.get(_EXECUTOR) == "slurm":
            return slurm_rank_info(self.env, self.launcher)
        return self._local_rank_info()

    def _local_rank_info(self) -> RankInfo:
        env, names = self.env, self._VARS
        rank, local_rank, world_size, node_rank, num_nodes = (
            require_int(env, names[field], hint=_HINT)
            for field in ("rank", "local_rank", "world_size", "node_rank", "num_nodes")
        )
        addr, port = master_from_env(env)
        if port is None:
            job_id = env.get(names["job_id"])
            if job_id is None:
                raise ConfigError(f"{names['job_id']} is not set", hint=_HINT)
            port = port_for_job(job_id)
        info = RankInfo(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=world_size,  # one machine: every task of the job is local
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=addr or "127.0.0.1",
            master_port=port,
            launcher=self.launcher,
        )
        return validate.check_rank_info(info, {**names, "local_world_size": names["world_size"]})
