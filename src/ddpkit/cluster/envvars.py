"""Typed reading of environment variables from a snapshot, shared by every environment, and
the one reading of a number a user typed (a variable or a flag).

Numbers are ASCII: :func:`to_int` and :func:`to_float` accept the digits 0-9 only, where
``int()`` also takes ``"３"``, ``"٣"``, ``"1_000"`` and surrounding blanks (and
``str.isdigit()`` takes ``"²"``, which ``int()`` then rejects with a traceback): a number in
another script's digits is a typo to report, not a value to guess. Every integer variable goes
through :func:`parse_int`, so a bad value is always the same one-line ``ConfigError`` naming
the variable and its value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ddpkit.errors import ConfigError
from ddpkit.masking import assignment, mask_text

__all__ = [
    "env_bool",
    "env_int",
    "first_set",
    "master_from_env",
    "number_hint",
    "parse_int",
    "parse_port",
    "require_int",
    "require_set",
    "to_float",
    "to_int",
]


def first_set(env: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    """(variable, value) of the first of ``names`` that is set in ``env``, else None."""
    for name in names:
        if name in env:
            return name, env[name]
    return None


def require_set(env: Mapping[str, str], names: Sequence[str], *, hint: str) -> tuple[str, str]:
    """:func:`first_set`, or a ConfigError naming every one of ``names`` when none is set."""
    found = first_set(env, names)
    if found is None:
        raise ConfigError(f"{' / '.join(names)} is not set", hint=hint)
    return found


# ASCII digits only: int() would also accept "1_000", "٣" or surrounding whitespace.
_INT = re.compile(r"-?[0-9]+")
_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


def to_int(text: str) -> int | None:
    """``text`` as an int when it is ASCII digits (an optional leading ``-``), else None."""
    return int(text) if _INT.fullmatch(text) else None


def to_float(text: str) -> float | None:
    """``text`` as a float when it is a plain ASCII decimal (``1``, ``0.5``, ``1e-3``), else
    None: no ``inf``, ``nan``, ``1_0`` nor non-ASCII digits."""
    return float(text) if _FLOAT.fullmatch(text) else None


def number_hint(text: str, hint: str) -> str:
    """``hint``, with a note when ``text`` holds a digit that is not ASCII (``²``, ``３``)."""
    if any(not char.isascii() and char.isnumeric() for char in text):
        return f"{hint}; only the ASCII digits 0-9 are read, and {mask_text(text)!r} has others"
    return hint


def parse_int(name: str, value: str, *, hint: str) -> int:
    """``value`` (read from variable ``name``) as an int, or a ConfigError naming both."""
    number = to_int(value)
    if number is None:
        raise ConfigError(
            f"{assignment(name, value)} is not an integer", hint=number_hint(value, hint)
        )
    return number


def env_int(env: Mapping[str, str], name: str, *, hint: str) -> int | None:
    """The integer in ``env[name]``, or None when the variable is not set."""
    value = env.get(name)
    return None if value is None else parse_int(name, value, hint=hint)


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def env_bool(env: Mapping[str, str], name: str, *, hint: str) -> bool | None:
    """``env[name]`` as a boolean (1/true/yes/on, 0/false/no/off, any case), or None when the
    variable is unset or empty; a ConfigError naming it for anything else."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return None
    if raw in _TRUE or raw in _FALSE:
        return raw in _TRUE
    raise ConfigError(f"{assignment(name, env[name])} is not a boolean", hint=hint)


def require_int(env: Mapping[str, str], names: str | Sequence[str], *, hint: str) -> int:
    """The integer in the first of ``names`` that is set; ConfigError naming them all if none."""
    name, value = require_set(env, [names] if isinstance(names, str) else names, hint=hint)
    return parse_int(name, value, hint=hint)


def parse_port(name: str, value: str, hint: str | None = None) -> int:
    """A TCP port from variable (or flag) ``name``: an integer in 1..65535."""
    hint = hint or f"set {name} to a free TCP port between 1 and 65535, e.g. 29500"
    port = parse_int(name, value, hint=hint)
    if not 1 <= port <= 65535:
        raise ConfigError(f"{assignment(name, value)} is not a TCP port (1..65535)", hint=hint)
    return port


def master_from_env(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """MASTER_ADDR and MASTER_PORT when set (None for each one that is not)."""
    addr = env.get("MASTER_ADDR")
    if addr is not None and not addr.strip():
        raise ConfigError(
            f"MASTER_ADDR={addr!r} is empty",
            hint="set MASTER_ADDR to the host name or IP address of rank 0, or unset it",
        )
    raw_port = env.get("MASTER_PORT")
    port = None if raw_port is None else parse_port("MASTER_PORT", raw_port)
    return (None if addr is None else addr.strip()), port
