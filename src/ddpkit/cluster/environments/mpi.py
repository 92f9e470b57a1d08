"""Processes started by ``mpirun``/``mpiexec``: Open MPI, MPICH/Intel MPI (hydra), MVAPICH.

Only the variables each implementation's launcher exports are read; ``mpi4py`` is never
imported. Ranks are assumed to be placed by node in blocks (mpirun's default ``--map-by
slot``/``core``), so ``node_rank = rank // local_world_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ddpkit.cluster import validate
from ddpkit.cluster.environments.base import ClusterEnvironment
from ddpkit.cluster.envvars import master_from_env, require_int
from ddpkit.cluster.rankinfo import Launcher, RankInfo
from ddpkit.cluster.rendezvous.ports import port_for_job
from ddpkit.errors import ConfigError

__all__ = ["MpiEnvironment"]

_HINT = "mpirun sets this for every rank; start the job with `mpirun -np N python ...`"

# Job identifiers shared by all ranks of one mpirun, in the order they are trusted: PMIx
# (Open MPI >= 4 with PMIx, srun --mpi=pmix), Open MPI's ess, PMI-1/2 (hydra), MVAPICH's
# mpirun_rsh. With none of them a single-node job falls back to torchrun's default port.
_JOB_ID_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID", "MPIRUN_ID")
_DEFAULT_PORT = 29500


class MpiEnvironment(ClusterEnvironment):
    """Detected by the world-size variable of any of the supported MPI implementations."""

    launcher: ClassVar[Launcher] = "mpi"
    # One table per implementation, tried in this order.
    _FLAVOURS: ClassVar[dict[str, dict[str, str]]] = {
        "openmpi": {
            "rank": "OMPI_COMM_WORLD_RANK",
            "world_size": "OMPI_COMM_WORLD_SIZE",
            "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
            "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
        },
        "mvapich": {
            "rank": "MV2_COMM_WORLD_RANK",
            "world_size": "MV2_COMM_WORLD_SIZE",
            "local_rank": "MV2_COMM_WORLD_LOCAL_RANK",
            "local_world_size": "MV2_COMM_WORLD_LOCAL_SIZE",
        },
        "hydra": {
            "rank": "PMI_RANK",
            "world_size": "PMI_SIZE",
            "local_rank": "MPI_LOCALRANKID",
            "local_world_size": "MPI_LOCALNRANKS",
        },
    }

    @staticmethod
    def flavour(env: Mapping[str, str]) -> str | None:
        """Which MPI implementation's variables ``env`` carries (None: no MPI)."""
        for name, table in MpiEnvironment._FLAVOURS.items():
            if table["world_size"] in env:
                return name
        return None

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return MpiEnvironment.flavour(env) is not None

    def rank_info(self) -> RankInfo:
        # not detected (built by hand): Open MPI's variables, named as missing
        names = dict(self._FLAVOURS[self.flavour(self.env) or "openmpi"])
        rank, world_size, local_rank, local_world_size = (
            require_int(self.env, names[field], hint=_HINT)
            for field in ("rank", "world_size", "local_rank", "local_world_size")
        )
        validate.check_sizes(names=names, local_world_size=local_world_size)
        num_nodes = -(-world_size // local_world_size)  # ceil without floats
        names |= {"node_rank": f"{names['rank']} // {names['local_world_size']}"}
        names |= {"num_nodes": f"ceil({names['world_size']} / {names['local_world_size']})"}
        node_rank = rank // local_world_size
        addr, port = self._master(num_nodes)
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

    def _master(self, num_nodes: int) -> tuple[str, int]:
        addr, port = master_from_env(self.env)
        if addr is None:
            if num_nodes > 1:
                raise ConfigError(
                    f"MASTER_ADDR is not set and the MPI job spans {num_nodes} nodes",
                    hint="export the host of rank 0 to every rank, e.g. "
                    "`mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...` (Open MPI) "
                    "or `mpiexec -genv MASTER_ADDR $(hostname) ...` (MPICH/Intel MPI)",
                )
            addr = "127.0.0.1"
        if port is None:
            job_id = next((self.env[name] for name in _JOB_ID_VARS if self.env.get(name)), None)
            port = _DEFAULT_PORT if job_id is None else port_for_job(job_id)
        return addr, port
