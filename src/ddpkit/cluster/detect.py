"""Which launcher started this process, and who this process is: the one entry point.

The detection order lives in :data:`DETECTION_ORDER` and nowhere else. torchrun comes first
because it is often started inside a SLURM step (its workers then see both sets of
variables, and torchrun's describe them); submitit before SLURM because submitit jobs are
SLURM jobs too; MPI after SLURM (SLURM's own ``detect`` steps aside for processes started by
mpirun inside an allocation); ``single`` is the fallback and always matches.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpkit.cluster.environments.base import ClusterEnvironment
from ddpkit.cluster.environments.mpi import MpiEnvironment
from ddpkit.cluster.environments.single import SingleEnvironment
from ddpkit.cluster.environments.slurm import SlurmEnvironment
from ddpkit.cluster.environments.submitit import SubmititEnvironment
from ddpkit.cluster.environments.torchrun import TorchrunEnvironment
from ddpkit.cluster.rankinfo import RankInfo

__all__ = ["DETECTION_ORDER", "detect", "detect_environment"]

DETECTION_ORDER: tuple[type[ClusterEnvironment], ...] = (
    TorchrunEnvironment,
    SubmititEnvironment,
    SlurmEnvironment,
    MpiEnvironment,
    SingleEnvironment,
)


def detect_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """The first environment in DETECTION_ORDER that recognises ``env`` (default os.environ).

    ``env`` is copied once, so later changes to it (or to ``os.environ``) do not leak into
    the returned environment. Nothing is written, printed or warned.
    """
    snapshot = dict(os.environ if env is None else env)
    for environment in DETECTION_ORDER:
        if environment.detect(snapshot):
            return environment(snapshot)
    return SingleEnvironment(snapshot)


def detect(env: Mapping[str, str] | None = None) -> RankInfo:
    """This process's :class:`RankInfo`, from ``env`` (default ``os.environ``); pure."""
    return detect_environment(env).rank_info()
