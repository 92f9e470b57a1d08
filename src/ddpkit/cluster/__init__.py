"""Where am I, who am I: launcher detection, hostlists, rank arithmetic, process-group setup.

Importing this package does not import torch; only :mod:`ddpkit.cluster.process_group` does.
"""

from __future__ import annotations

from ddpkit.cluster.detect import detect, detect_environment
from ddpkit.cluster.nodelist import expand_nodelist
from ddpkit.cluster.rankinfo import RankInfo

__all__ = ["RankInfo", "detect", "detect_environment", "expand_nodelist"]
