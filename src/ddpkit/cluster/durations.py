"""Seconds from keyword arguments and environment variables: one parser for every timeout knob.

``DDPKIT_CONNECT_TIMEOUT``, ``DDPKIT_COLLECTIVE_TIMEOUT``, ``DDPKIT_PEER_TIMEOUT`` and the hang
watchdog's bounds (and their keyword arguments) are read here, so they accept the same spellings
and fail the same way: a ``ConfigError`` naming the argument or variable and the value as
written, with a hint. Pure and torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ddpkit.cluster.envvars import number_hint, to_float
from ddpkit.contract import BOUND_PER_RANK_S
from ddpkit.errors import ConfigError
from ddpkit.masking import assignment

__all__ = ["positive_seconds", "scaled_bound", "seconds_from_env", "seconds_or_off"]


def positive_seconds(
    value: float, name: str, *, hint: str | None = None, shown: str | None = None
) -> float:
    """``value`` as a float, if it is a positive, finite number (bools refused).

    ``shown``: the text to quote in the error (an environment variable's raw value).
    """
    text = repr(value) if shown is None else repr(shown)
    advice = hint or f"e.g. {name}=60"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name}={text} is not a number of seconds", hint=advice)
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(
            f"{name}={text} must be a positive, finite number of seconds", hint=advice
        )
    return float(value)


def seconds_from_env(
    env: Mapping[str, str], name: str, *, example: str, hint: str | None = None
) -> float | None:
    """``env[name]`` as a positive number of seconds; None when unset or blank."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    advice = hint or f"e.g. {name}={example}"
    value = to_float(raw)
    if value is None:
        raise ConfigError(
            f"{assignment(name, raw)} is not a number of seconds", hint=number_hint(raw, advice)
        )
    return positive_seconds(value, name, hint=advice, shown=raw)


def scaled_bound(base_s: float, ranks: int) -> float:
    """A default start-up bound for a job of ``ranks`` ranks: ``base_s`` + 10 ms a rank after
    the first (:data:`~ddpkit.contract.BOUND_PER_RANK_S`): the ranks reach one store one by
    one. Only defaults scale; a bound the user set is used as given."""
    return base_s + BOUND_PER_RANK_S * max(0, ranks - 1)


def seconds_or_off(
    env: Mapping[str, str],
    explicit_s: float | None,
    variable: str,
    keyword: str,
    default_s: float,
    *,
    example: str,
    can_be_off: bool = True,
) -> float | None:
    """Seconds from a keyword (wins) or ``variable``, else ``default_s``; None for ``0`` (or
    ``off``) when it ``can_be_off``. A bad value is a ConfigError naming it."""
    off = ", or 0 for off" if can_be_off else ""
    if explicit_s is not None:
        if can_be_off and explicit_s == 0 and not isinstance(explicit_s, bool):
            return None
        return positive_seconds(explicit_s, keyword, hint=f"e.g. {keyword}={example}{off}")
    raw = env.get(variable, "").strip().lower()
    if can_be_off and (raw == "off" or to_float(raw) == 0):
        return None
    hint = f"e.g. {variable}={example}" + (f", or {variable}=off" if can_be_off else "")
    value = seconds_from_env(env, variable, example=example, hint=hint)
    return default_s if value is None else value
