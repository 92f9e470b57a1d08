"""The launcher's SIGUSR1/SIGUSR2, from its first line to its exit: passed on, never deadly.

Their default action would end the launcher while Python and torch start, between worker
groups and while it tears down, so the ``ddpkit`` entry point calls :func:`hold` first thing:

* The stop signal (``DDPKIT_SIGNAL``, else SIGUSR2) is blocked, and relayed to the workers
  once the command line is parsed (:func:`relay_stop_signal`): in a ddpkit job the workers
  start with it pending until they latch it; outside one it is unblocked and sent only to
  workers that catch it: a worker is never killed by a signal sent to the launcher.
* The other one is sent to the running workers (none: dropped).

Both are ignored from the atexit handlers on. On Windows the launcher holds nothing.
"""

from __future__ import annotations

import atexit
import signal
import threading
from collections.abc import Mapping, Sequence

from ddpkit.cluster.stop import forward
from ddpkit.cluster.stop.latch import announce
from ddpkit.cluster.stop.signals import signal_from_env, stop_signal

__all__ = ["FORWARDED", "hold", "relay_stop_signal"]

# getattr: neither exists on Windows, where the launcher holds nothing
FORWARDED = tuple(getattr(signal, name) for name in ("SIGUSR1", "SIGUSR2") if hasattr(signal, name))


def hold(argv: Sequence[str], env: Mapping[str, str]) -> signal.Signals | None:
    """First thing in the ``ddpkit`` process: for ``ddpkit run``, block the stop signal and
    handle the other forwarded one (see the module docstring); the stop signal, or None."""
    if not argv or argv[0] != "run" or threading.current_thread() is not threading.main_thread():
        return None
    if not FORWARDED or not hasattr(signal, "pthread_sigmask"):  # not a POSIX system
        return None
    stop = stop_signal(env, lenient=True)  # a bad value is reported later, as a one-line error
    forward.block(stop)
    others = [sig for sig in FORWARDED if sig != stop]
    for sig in others:
        signal.signal(sig, forward.forward_now)
    atexit.register(forward.ignore_at_exit, others)
    return stop


def relay_stop_signal(env: Mapping[str, str]) -> None:
    """Pass the stop signal on to the workers from now on, from the thread that will start them
    (see the module docstring); in a ddpkit job the batch shell is told the agent holds it."""
    in_job = signal_from_env(env)  # strict: a bad DDPKIT_SIGNAL is a ConfigError here
    stop = in_job or forward.held()
    if stop is None:
        return
    if forward.held() != stop:
        forward.block(stop)
    if forward.start(stop, catching_only=in_job is None) and in_job is None:
        forward.release(stop)
    if in_job:
        announce(env)
