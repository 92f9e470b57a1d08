"""Launcher environments, one small module each (the variable readers they share are in
:mod:`ddpkit.cluster.envvars`). The environment classes are exported lazily so that importing a
single environment module does not import the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit._lazy import lazy_exports

__all__ = [
    "ClusterEnvironment",
    "MpiEnvironment",
    "SingleEnvironment",
    "SlurmEnvironment",
    "SubmititEnvironment",
    "TorchEnvEnvironment",
    "TorchrunEnvironment",
]

_EXPORTS: dict[str, str] = {
    "ClusterEnvironment": "ddpkit.cluster.environments.base",
    "MpiEnvironment": "ddpkit.cluster.environments.mpi",
    "SingleEnvironment": "ddpkit.cluster.environments.single",
    "SlurmEnvironment": "ddpkit.cluster.environments.slurm",
    "SubmititEnvironment": "ddpkit.cluster.environments.submitit",
    "TorchEnvEnvironment": "ddpkit.cluster.environments.torchenv",
    "TorchrunEnvironment": "ddpkit.cluster.environments.torchrun",
}

if TYPE_CHECKING:
    from ddpkit.cluster.environments.base import ClusterEnvironment
    from ddpkit.cluster.environments.mpi import MpiEnvironment
    from ddpkit.cluster.environments.single import SingleEnvironment
    from ddpkit.cluster.environments.slurm import SlurmEnvironment
    from ddpkit.cluster.environments.submitit import SubmititEnvironment
    from ddpkit.cluster.environments.torchenv import TorchEnvEnvironment
    from ddpkit.cluster.environments.torchrun import TorchrunEnvironment

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
