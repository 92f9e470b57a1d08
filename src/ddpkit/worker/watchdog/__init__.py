"""The peer watchdog: when a rank exits early, dies or freezes, its peers end within a bound.

Without it, a rank that leaves the job (a bug that skips the loop, a crash, ``kill -9``, a dead
node) is learned of from the backend: gloo fails at once with "Connection closed by peer
[address]" (no rank named), NCCL blocks until the collective timeout (10-30 min). ``init()``
starts a watchdog when it creates a group of several ranks (not when it adopts someone else's);
``shutdown()`` stops it. The bound is ``init(peer_timeout_s=)``, else ``DDPKIT_PEER_TIMEOUT``
(seconds; ``0`` or ``off`` disables it), else 60 s; the watchdog polls every
``min(1 s, bound / 4)``.

It talks over the job's rendezvous store only (keys under ``ddpkit/watchdog/``, below the
group's own prefixes), never over a collective, from one daemon thread, ``ddpkit-watchdog``,
on a connection of its own to the default group's store, opened by ``init()`` on the calling
thread (a TCPStore client bounded by ``T``; without one, ``init()`` warns and runs without the
watchdog). ``T = min(10 s, bound / 2)`` bounds every store operation (its socket's receive and
send timeouts: torch's own timeout bounds only waits for a key): one that fails or times out
means the store's host is gone.

* Exit markers. A rank leaving writes ``exit/<rank>`` (host, pid, how: "exited", "raised
  ValueError: ...", "left the job (ddpkit.shutdown())"), appends its rank to ``order`` and bumps
  ``events``: at exit (the first step of :mod:`ddpkit.worker.exit`, before the group is
  destroyed, since destroying it is what wakes the peers), in ``shutdown()``, and from a
  chained ``sys.excepthook`` for an uncaught exception.
* Heartbeats. Every rank bumps ``beat/<rank>`` each interval, at a moment of it of its own
  (``beat_phase``); rank 0 alone reads them (a ``multi_get`` a slice of keys; past 1,024 ranks
  a part of them each interval, ``judging_parts``) and judges them
  (:mod:`~ddpkit.worker.watchdog.beats`): it writes the marker of a rank whose counter
  has not moved for the bound ("stopped sending heartbeats N s ago"): ``kill -9``, a frozen
  process, a dead node. Time is each process's monotonic clock, so clocks need not agree. A
  store that stops answering, or closes the connection, means its host is gone: rank 0
  (``tcp://``, ``env://`` outside torchrun) or the launcher's agent; once the host's own marker
  is read no more store operation is made (its store goes next). Per beat interval each rank
  costs the store two operations (a beat and one ``events`` poll); per interval rank 0 makes
  one more, of up to 1,024 keys.
* Exit bound. Stopping the watchdog (at exit, in ``shutdown()``) waits at most ``T`` for a
  store operation in flight, then shuts its socket down (the call returns at once), then writes
  the marker (one reply awaited, ``T`` at most): ``2 x T`` in all, within the bound; a few
  milliseconds when the store answers. No thread of the watchdog's is then inside a torch
  call when the interpreter finalizes (one that returned then would abort the process).
* Survivors. A peer's marker alone ends nobody: at the end of a run ranks leave at slightly
  different times, and rank 0 may work on alone. A rank is ended only when, after a peer left,
  the thread that called ``init()`` (the main thread, usually) has been *blocked* for the whole
  bound: the same innermost frame at the same instruction at every sample and, on Linux, no
  voluntary context switch of that thread (a loop of short sleeps or waits keeps switching; a
  thread blocked in a collective or a device sync does not; elsewhere only the frame counts).
  It then prints where it was blocked and one line naming the peer, e.g.
  ``ddpkit: rank 1 on host nodeB (pid 4242) exited while rank 0 was waiting for it in a
  collective; ending rank 0 after 5.0 s (bound: DDPKIT_PEER_TIMEOUT=5)``, terminates its own
  child processes (data loader workers) and exits with code 1.
* With gloo a survivor usually fails at once ("Connection closed by peer"). The excepthook then
  waits briefly for the marker of the rank that left first (none when it was killed: then for
  rank 0's list of the ranks whose heartbeats stood still for 2.2 beat intervals; 2.5 s, up to
  5 s while none is listed), and prints the same kind of line after the traceback, where
  launchers look for the cause.

Only a rank blocked while a collective of its own is in flight (DDP's all-reduces inside
``backward()`` too), as torch's flight recorder shows (:mod:`.flight`), is ended: that call can
never complete once a peer has left. A training thread in ONE long call of its own (a C call, a
single long ``time.sleep``) looks just as blocked and is left alone. With the hang watchdog off
the recorder is not read, and a rank blocked for the bound is taken as waiting (the former
guess: raise the bound, or call ``ddpkit.shutdown()`` before such solo work). A rank whose
threads cannot run for the bound (the GIL held that long) is reported by rank 0 as silent.
A rank that hangs while alive and keeps sending heartbeats is the hang watchdog's (same thread,
same store): a rank in one collective past ``DDPKIT_HANG_TIMEOUT`` gathers every rank's stack
and last collectives into one report naming the stuck rank, and the job goes on unless
``DDPKIT_HANG_ACTION=end`` (:mod:`.hang`, :mod:`.hangwatch`, :mod:`.flight`), which names a
rank waiting in a collective inside rank-0-only code (:mod:`.rankzero_if`); nothing raises
before a collective.

Layout: :mod:`.policy` (pure: bound, who left first, messages), :mod:`.liveness` (is the
training thread blocked), :mod:`.store` (the store operations), :mod:`.watcher` (the thread),
:mod:`.hooks` (process-wide wiring: start, stop, excepthook, exit step, own connection). Only
starting a watchdog imports torch.
"""

from __future__ import annotations

from ddpkit.contract import DEFAULT_PEER_TIMEOUT_S, PEER_TIMEOUT_VAR
from ddpkit.worker.watchdog.hang import HangBounds, hang_bounds
from ddpkit.worker.watchdog.hooks import active, start, stop
from ddpkit.worker.watchdog.liveness import Progress
from ddpkit.worker.watchdog.policy import (
    ABORT_EXIT_CODE,
    THREAD_NAME,
    Departure,
    abort_message,
    beat_interval_for,
    beat_phase,
    describe_rank,
    interval_for,
    judging_parts,
    looks_like_peer_failure,
    peer_timeout,
    pick_cause,
    raised_message,
)
from ddpkit.worker.watchdog.straggler import straggler_interval
from ddpkit.worker.watchdog.watcher import Watchdog

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
    "beat_phase",
    "describe_rank",
    "hang_bounds",
    "interval_for",
    "judging_parts",
    "looks_like_peer_failure",
    "peer_timeout",
    "pick_cause",
    "raised_message",
    "start",
    "stop",
    "straggler_interval",
]
