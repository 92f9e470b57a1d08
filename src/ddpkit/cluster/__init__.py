"""Who and where am I: launcher detection (a module per environment), hostlists, pure rank
arithmetic, ports, device choice and the consistency checks, all from a snapshot of the
environment.

Nothing here imports torch or does I/O beyond reading the mapping it is given (tests check
both): the launcher (:mod:`ddpkit.launch`), the job tools (:mod:`ddpkit.jobs`) and the worker
(:mod:`ddpkit.worker`, which joins the process group) all build on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit._lazy import lazy_exports

__all__ = ["RankInfo", "detect", "detect_environment", "expand_nodelist"]

# Lazy: ``ddpkit run``'s first line imports ddpkit.cluster.stop to hold the stop signal, and
# must not pay for detection's imports first (tens of milliseconds in which the signal kills).
_EXPORTS = {
    "RankInfo": "ddpkit.cluster.rankinfo",
    "detect": "ddpkit.cluster.detect",
    "detect_environment": "ddpkit.cluster.detect",
    "expand_nodelist": "ddpkit.cluster.nodelist",
}

if TYPE_CHECKING:
    from ddpkit.cluster.detect import detect, detect_environment
    from ddpkit.cluster.nodelist import expand_nodelist
    from ddpkit.cluster.rankinfo import RankInfo

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
