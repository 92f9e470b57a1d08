"""The peer watchdog: when a rank exits early, dies or freezes, its peers end within a bound.

``init()`` starts it for a group of several ranks; ``shutdown()`` and the exit stop it. One
thread, on a store connection of its own opened in ``init()``: exit markers and heartbeats
(:mod:`.store`); a survivor ended only when blocked for the bound inside a collective, as
torch's flight recorder shows (:mod:`.watcher`, :mod:`.flight`); one report per hang naming the
stuck rank, its frame and collective (:mod:`.hangwatch`, :mod:`.hang`); pure policy in
:mod:`.policy`. Bounds, costs and keys: docs/concepts/in-your-process.md.
"""

from __future__ import annotations

from ddpkit.worker.watchdog.hang import HangBounds, hang_bounds
from ddpkit.worker.watchdog.policy import ABORT_EXIT_CODE, peer_timeout
from ddpkit.worker.watchdog.watcher import Watchdog, active, start, stop

__all__ = [
    "ABORT_EXIT_CODE",
    "HangBounds",
    "Watchdog",
    "active",
    "hang_bounds",
    "peer_timeout",
    "start",
    "stop",
]
