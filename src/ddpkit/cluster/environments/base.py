"""The one interface every launcher environment implements.

An environment is a read-only view over a snapshot of environment variables. ``detect`` is a
pure static predicate; ``rank_info`` computes the frozen :class:`RankInfo`. Neither writes
``os.environ``, prints, or warns: anything the user should hear goes into ``RankInfo.notes``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

from ddpkit.cluster.rankinfo import Launcher, RankInfo

__all__ = ["ClusterEnvironment"]


class ClusterEnvironment(ABC):
    """Base class: one subclass per launcher (torchrun, submitit, SLURM, MPI, single)."""

    launcher: ClassVar[Launcher]

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env: Mapping[str, str] = MappingProxyType(dict(env))

    @property
    def env(self) -> Mapping[str, str]:
        """The (read-only) variables this environment was built from."""
        return self._env

    @staticmethod
    @abstractmethod
    def detect(env: Mapping[str, str]) -> bool:
        """True when ``env`` looks like this launcher started the process."""

    @abstractmethod
    def rank_info(self) -> RankInfo:
        """This process's rank record; raises ``ConfigError``/``TopologyError`` with a hint."""
