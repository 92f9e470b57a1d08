"""The rank record: who this process is in the job. Frozen, computed once, never mutated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ddpkit.cluster.rendezvous.ports import PortSearch

__all__ = ["ANY_PORT", "Launcher", "RankInfo"]

# "env": torch's env:// variables alone (RANK, WORLD_SIZE, MASTER_*), set by no known launcher.
Launcher = Literal["torchrun", "slurm", "submitit", "mpi", "env", "single"]
# ``master_port`` of a world of one started without MASTER_PORT: no port is chosen yet.
ANY_PORT = 0


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job.

    ``rank``/``world_size`` are global; ``local_rank``/``local_world_size`` count the processes on
    this node; ``node_rank``/``num_nodes`` count nodes. ``master_addr``/``master_port`` are where
    rank 0 hosts the rendezvous store: ``ANY_PORT`` (0) for a world of one without MASTER_PORT
    (``ddpkit.init`` gives a world of one an in-process store, on no port at all). ``port_search``,
    when set, lists the ports rank 0 may host it on instead (``master_port`` is the first; see
    :mod:`ddpkit.cluster.rendezvous.ports`); the rank record :func:`ddpkit.init` keeps has the
    port actually used. ``launcher`` names the environment that started us. ``notes`` carries
    warnings detection wants the user to see (shown once by ``ddpkit.init``); detection itself
    never prints, warns or does I/O (it runs on every ``ddpkit.print`` before ``init``).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    launcher: Launcher
    notes: tuple[str, ...] = field(default=(), compare=False)
    port_search: PortSearch | None = field(default=None, compare=False)

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    def to_env(self) -> dict[str, str]:
        """The torchrun-style variables describing this rank, for child processes.

        ddpkit never writes these into ``os.environ`` itself; pass them to a subprocess's
        ``env=`` when a child must see the same view.
        """
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
