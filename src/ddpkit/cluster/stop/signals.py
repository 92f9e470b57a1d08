"""The stop signal's vocabulary and defaults, its one parser and its one reader.

Two sets, one definition (a change here reaches the spec, the guard, the latch, the launcher
and the job scripts):

* :data:`JobSignal` / :data:`JOB_SIGNALS`: what a job spec's ``signal:`` takes, and so what
  ddpkit's job scripts hold, count and pass on. Only USR1 and USR2: SLURM ends every job with
  TERM, and the batch shell and each task wrapper outlive TERM, INT, HUP and QUIT on purpose,
  so a job script cannot tell "stop soon" from those.
* :data:`ALLOWED_SIGNALS`: what ``DDPKIT_SIGNAL`` (set by hand) or ``preemption_guard(signal)``
  may name, for a cluster whose only warning is one of those.

The defaults are :mod:`ddpkit.contract`'s; ``DDPKIT_SIGNAL`` is read by
:func:`signal_from_env` only.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Literal, get_args

from ddpkit.cluster.envvars import number_hint, to_int
from ddpkit.contract import DEFAULT_MAX_REQUEUES, DEFAULT_SIGNAL, SIGNAL_VAR
from ddpkit.errors import ConfigError

__all__ = [
    "ALLOWED_SIGNALS",
    "DEFAULT_MAX_REQUEUES",
    "DEFAULT_SIGNAL",
    "EXIT_STOPPED",
    "JOB_SIGNALS",
    "JobSignal",
    "parse_signal",
    "signal_from_env",
    "stop_signal",
]

JobSignal = Literal["USR1", "USR2"]
JOB_SIGNALS: tuple[str, ...] = get_args(JobSignal)
ALLOWED_SIGNALS: tuple[str, ...] = (*JOB_SIGNALS, "HUP", "INT", "TERM", "URG", "XCPU")
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped with a checkpoint, not requeued; run again to resume


def parse_signal(value: str | int | signal.Signals, *, name: str = SIGNAL_VAR) -> signal.Signals:
    """``"USR2"``, ``"SIGUSR2"``, ``12`` or ``signal.SIGUSR2`` -> ``signal.SIGUSR2``; a
    ConfigError naming ``name`` for anything but :data:`ALLOWED_SIGNALS`."""
    if isinstance(value, signal.Signals):
        return value
    text = str(value).strip().upper()
    number = to_int(text)
    if number is not None:
        try:
            found = signal.Signals(number)
        except ValueError:
            found = None
    else:
        found = getattr(signal, text if text.startswith("SIG") else f"SIG{text}", None)
    if not isinstance(found, signal.Signals) or found.name[3:] not in ALLOWED_SIGNALS:
        raise ConfigError(
            f"{name}={value!r} is not a signal ddpkit can stop on",
            hint=number_hint(
                text, f"one of {', '.join(ALLOWED_SIGNALS)} ({DEFAULT_SIGNAL} is the default)"
            ),
        )
    return found


def signal_from_env(env: Mapping[str, str], *, lenient: bool = False) -> signal.Signals | None:
    """The signal ``DDPKIT_SIGNAL`` names in ``env`` (a ddpkit job sets it), None when unset.

    ``lenient``: a value that is no stop signal reads as the default instead of raising (the
    launcher's first line, which must hold a signal before it can report anything; it reports
    the bad value later, strictly).
    """
    text = env.get(SIGNAL_VAR, "").strip()
    if not text:
        return None
    try:
        return parse_signal(text)
    except ConfigError:
        if lenient:
            return parse_signal(DEFAULT_SIGNAL)
        raise


def stop_signal(env: Mapping[str, str], *, lenient: bool = False) -> signal.Signals:
    """The stop signal: ``DDPKIT_SIGNAL``'s, else the default (USR2)."""
    return signal_from_env(env, lenient=lenient) or parse_signal(DEFAULT_SIGNAL)
