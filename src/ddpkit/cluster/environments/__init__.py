"""Launcher environments, one small module each (the variable readers they share are in
:mod:`ddpkit.cluster.envvars`); :mod:`ddpkit.cluster.detect` holds their detection order.
"""

from __future__ import annotations

from ddpkit.cluster.environments.base import ClusterEnvironment
from ddpkit.cluster.environments.mpi import MpiEnvironment
from ddpkit.cluster.environments.single import SingleEnvironment
from ddpkit.cluster.environments.slurm import SlurmEnvironment
from ddpkit.cluster.environments.submitit import SubmititEnvironment
from ddpkit.cluster.environments.torchenv import TorchEnvEnvironment
from ddpkit.cluster.environments.torchrun import TorchrunEnvironment

__all__ = [
    "ClusterEnvironment",
    "MpiEnvironment",
    "SingleEnvironment",
    "SlurmEnvironment",
    "SubmititEnvironment",
    "TorchEnvEnvironment",
    "TorchrunEnvironment",
]
