"""Who and where am I: launcher detection (a module per environment), hostlists, pure rank
arithmetic, ports, device choice and the consistency checks, all from a snapshot of the
environment.

Nothing here imports torch or does I/O beyond reading the mapping it is given (tests check
both): the launcher (:mod:`ddpkit.launch`), the job tools (:mod:`ddpkit.jobs`) and the worker
(:mod:`ddpkit.worker`, which joins the process group) all build on it.
"""

from __future__ import annotations

from ddpkit.cluster.detect import detect, detect_environment
from ddpkit.cluster.nodelist import expand_nodelist
from ddpkit.cluster.rankinfo import RankInfo

__all__ = ["RankInfo", "detect", "detect_environment", "expand_nodelist"]
