"""The peer watchdog: when a rank exits early, dies or freezes, its peers end within a bound.

``init()`` starts one when it creates a group of several ranks; ``shutdown()`` and the exit stop
it. The bound: ``init(peer_timeout_s=)``, else ``DDPKIT_PEER_TIMEOUT`` (``0``/``off``: off), else
60 s. One daemon thread on a store connection of its own, opened in ``init()``:

* a leaving rank writes an exit marker; every rank beats, and rank 0 marks a rank whose beats
  stopped for the bound;
* a survivor is ended only when its main thread has been blocked for the bound inside a
  collective (torch's flight recorder): a rank in one long call of its own is left alone;
* the hang watchdog: a rank in one collective past ``DDPKIT_HANG_TIMEOUT`` gets one report
  naming the stuck rank, its frame and collective;
* exit bound ``2 x T``, ``T = min(10 s, bound / 2)``.

Modules: :mod:`.policy` (pure), :mod:`.store` (its connection, store operations),
:mod:`.watcher` (the thread, ``start``/``stop``), the hang watchdog (:mod:`.flight`,
:mod:`.hang`, :mod:`.hangwatch`). docs/concepts/in-your-process.md has costs, bounds and keys.
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
