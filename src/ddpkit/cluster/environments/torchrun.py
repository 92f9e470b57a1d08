"""torchrun / torchelastic workers, and other launchers that set torchrun's variables.

Checked first: torchrun is often started by srun inside a SLURM step, and then its own
variables, not SLURM's, describe the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ddpkit.cluster import validate
from ddpkit.cluster.environments.base import ClusterEnvironment
from ddpkit.cluster.environments.slurm import slurm_task
from ddpkit.cluster.envvars import env_int, master_from_env, require_int
from ddpkit.cluster.rankinfo import Launcher, RankInfo
from ddpkit.errors import ConfigError

__all__ = ["TorchrunEnvironment"]

_HINT = "torchrun sets this for every worker; start the script with `torchrun` or `ddpkit run`"


class TorchrunEnvironment(ClusterEnvironment):
    """Detected by TORCHELASTIC_RUN_ID, or by all of RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE."""

    launcher: ClassVar[Launcher] = "torchrun"
    _VARS: ClassVar[dict[str, str]] = {
        "rank": "RANK",
        "local_rank": "LOCAL_RANK",
        "world_size": "WORLD_SIZE",
        "local_world_size": "LOCAL_WORLD_SIZE",
        "node_rank": "GROUP_RANK",
        "num_nodes": "GROUP_WORLD_SIZE",
        "master_addr": "MASTER_ADDR",
        "master_port": "MASTER_PORT",
        "run_id": "TORCHELASTIC_RUN_ID",
    }
    _REQUIRED: ClassVar[tuple[str, ...]] = ("rank", "world_size", "local_rank", "local_world_size")

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        names = TorchrunEnvironment._VARS
        return names["run_id"] in env or all(
            names[field] in env for field in TorchrunEnvironment._REQUIRED
        )

    def rank_info(self) -> RankInfo:
        env, names = self.env, self._VARS
        rank, world_size, local_rank, local_world_size = (
            require_int(env, names[field], hint=_HINT) for field in self._REQUIRED
        )
        validate.check_sizes(names=names, local_world_size=local_world_size)
        node_rank = env_int(env, names["node_rank"], hint=_HINT)
        num_nodes = env_int(env, names["num_nodes"], hint=_HINT)
        if node_rank is None:
            node_rank = rank // local_world_size
        if num_nodes is None:
            num_nodes = -(-world_size // local_world_size)  # ceil without floats
        task = slurm_task(env)
        if task is not None:  # inside a SLURM step: the only srun task on its node
            validate.check_torchrun_in_slurm(
                srun_tasks_on_node=task.tasks_on_node,
                nproc_per_node=local_world_size,
                torchrun_rank=rank,
                torchrun_world_size=world_size,
                slurm_procid=task.rank,
                slurm_num_tasks=task.num_tasks,
            )
        addr, port = self._master(world_size)
        info = RankInfo(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=addr,
            master_port=port,
            launcher=self.launcher,
        )
        return validate.check_rank_info(info, names)

    def _master(self, world_size: int) -> tuple[str, int]:
        addr, port = master_from_env(self.env)
        if addr is not None and port is not None:
            return addr, port
        if world_size == 1:
            # A world of one never contacts a peer; torchrun's own defaults are harmless.
            return addr or "127.0.0.1", 29500 if port is None else port
        missing = "MASTER_ADDR" if addr is None else "MASTER_PORT"
        raise ConfigError(
            f"{missing} is not set but WORLD_SIZE={world_size}",
            hint=(
                "torchrun sets MASTER_ADDR and MASTER_PORT for its workers; a launcher that "
                "only sets RANK/WORLD_SIZE must also export both "
                "(e.g. MASTER_ADDR=<host of rank 0> MASTER_PORT=29500)"
            ),
        )
