"""The peer watchdog: when a rank exits early, dies or freezes, its peers end within a bound.

Without it, a rank that leaves is learned of from the backend: gloo fails at once without
naming it, NCCL blocks until the collective timeout (10-30 min). ``init()`` starts one when it
creates a group of several ranks; ``shutdown()`` and the exit stop it. The bound is
``init(peer_timeout_s=)``, else ``DDPKIT_PEER_TIMEOUT`` (``0``/``off``: off), else 60 s.

One daemon thread, ``ddpkit-watchdog``, on a store connection of its own opened in ``init()``,
every operation bounded by ``T = min(10 s, bound / 2)``:

* Exit markers: a rank leaving (at exit, in ``shutdown()``, from an uncaught exception) writes
  ``exit/<rank>``, which its peers poll. Heartbeats: every rank bumps ``beat/<rank>``; rank 0
  marks a rank whose counter stood still for the bound ("stopped sending heartbeats").
* Survivors: a peer's marker alone ends nobody. A rank is ended only when its main thread has
  been blocked for the whole bound while a collective of its own is in flight (torch's flight
  recorder, :mod:`.flight`): that call can never complete. A rank in one long call of its own
  is left alone. With gloo a survivor fails at once; its excepthook names the rank that left.
* Hangs: a rank in one collective past ``DDPKIT_HANG_TIMEOUT``, every rank alive, gets one
  report naming the stuck rank, its frame and collective (:mod:`.hang`, :mod:`.hangwatch`).
* Exit bound: stopping waits ``T`` at most for a store call in flight, then cuts its socket,
  then writes the marker (``T``): ``2 x T``, within the bound; no thread of the watchdog's is
  then inside a torch call when the interpreter finalizes.

Layout: :mod:`.policy` (pure), :mod:`.store` (store operations, rank 0's judging),
:mod:`.watcher` (the thread), :mod:`.hooks` (process-wide wiring), the hang watchdog
(:mod:`.flight`, :mod:`.hang`, :mod:`.hangwatch`, :mod:`.rankzero_if`), :mod:`.straggler`.
See docs/concepts/in-your-process.md for the costs, bounds and keys.
"""

from __future__ import annotations

from ddpkit.contract import DEFAULT_PEER_TIMEOUT_S, PEER_TIMEOUT_VAR
from ddpkit.worker.watchdog.hang import HangBounds, hang_bounds
from ddpkit.worker.watchdog.hooks import active, start, stop
from ddpkit.worker.watchdog.policy import (
    ABORT_EXIT_CODE,
    THREAD_NAME,
    Departure,
    abort_message,
    beat_interval_for,
    describe_rank,
    interval_for,
    looks_like_peer_failure,
    peer_timeout,
    pick_cause,
    raised_message,
)
from ddpkit.worker.watchdog.straggler import straggler_interval
from ddpkit.worker.watchdog.watcher import Progress, Watchdog

__all__ = [
    "ABORT_EXIT_CODE",
    "DEFAULT_PEER_TIMEOUT_S",
    "PEER_TIMEOUT_VAR",
    "THREAD_NAME",
    "Departure",
    "HangBounds",
    "Progress",
    "Watchdog",
    "abort_message",
    "active",
    "beat_interval_for",
    "describe_rank",
    "hang_bounds",
    "interval_for",
    "looks_like_peer_failure",
    "peer_timeout",
    "pick_cause",
    "raised_message",
    "start",
    "stop",
    "straggler_interval",
]
