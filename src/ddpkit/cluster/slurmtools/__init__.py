"""SLURM's command-line tools behind the one :class:`Runner` seam (torch-free)."""

from ddpkit.cluster.slurmtools.query import *  # noqa: F403
from ddpkit.cluster.slurmtools.query import Source, __all__  # noqa: F401
