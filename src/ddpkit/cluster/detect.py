"""Which launcher started this process, and who this process is: the one entry point.

The detection order lives in :data:`DETECTION_ORDER` and nowhere else: torchrun first (it is
often started inside a SLURM step, and its workers' own variables describe them); submitit
before SLURM (its jobs are SLURM jobs too); MPI after SLURM (SLURM's ``detect`` steps aside for
processes mpirun started in an allocation); ``env`` (torch's env:// variables set by none of
those: Kubeflow's PyTorchJob, ``mp.spawn`` in a batch script) after every launcher with
variables of its own; ``single`` last, always matching.

``detect`` also holds the launcher to the world size a ddpkit job script asked for
(DDPKIT_EXPECTED_WORLD_SIZE), so a script that starts the wrong number of processes fails
before anything trains alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpkit.cluster import validate
from ddpkit.cluster.environments.base import ClusterEnvironment
from ddpkit.cluster.environments.mpi import MpiEnvironment
from ddpkit.cluster.environments.single import SingleEnvironment
from ddpkit.cluster.environments.slurm import SlurmEnvironment
from ddpkit.cluster.environments.submitit import SubmititEnvironment
from ddpkit.cluster.environments.torchenv import TorchEnvEnvironment
from ddpkit.cluster.environments.torchrun import TorchrunEnvironment
from ddpkit.cluster.envvars import env_int
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.contract import EXPECTED_WORLD_SIZE_VAR, JOB_LAUNCH_VAR
from ddpkit.errors import ConfigError

__all__ = ["DETECTION_ORDER", "detect", "detect_environment"]

DETECTION_ORDER: tuple[type[ClusterEnvironment], ...] = (
    TorchrunEnvironment,
    SubmititEnvironment,
    SlurmEnvironment,
    MpiEnvironment,
    TorchEnvEnvironment,
    SingleEnvironment,
)


def detect_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """The first environment in DETECTION_ORDER that recognises ``env`` (default os.environ).

    ``env`` is copied once, so later changes to it (or to ``os.environ``) do not leak into
    the returned environment. Nothing is written, printed or warned.
    """
    snapshot = dict(os.environ if env is None else env)
    return next(found(snapshot) for found in DETECTION_ORDER if found.detect(snapshot))


def detect(env: Mapping[str, str] | None = None) -> RankInfo:
    """This process's :class:`RankInfo`, from ``env`` (default ``os.environ``); pure.

    Raises TopologyError when DDPKIT_EXPECTED_WORLD_SIZE is set and the launcher's world size
    differs from it.
    """
    snapshot = dict(os.environ if env is None else env)
    info = detect_environment(snapshot).rank_info()
    expected = _expected_world_size(snapshot)
    if expected is not None:
        validate.check_expected_world_size(
            expected=expected,
            world_size=info.world_size,
            launcher=info.launcher,
            job_launch=snapshot.get(JOB_LAUNCH_VAR),
        )
    return info


def _expected_world_size(env: Mapping[str, str]) -> int | None:
    name = EXPECTED_WORLD_SIZE_VAR
    hint = f"ddpkit job scripts export {name}=<nodes * procs_per_node>; unset it or fix it"
    expected = env_int(env, name, hint=hint)
    if expected is not None and expected < 1:
        raise ConfigError(f"{name}={expected} must be at least 1", hint=hint)
    return expected
