"""What every spec model shares: the error type ``ddpkit.jobs.load`` reads, and one-value checks.

``invalid`` builds a pydantic error of type ``"ddpkit"`` whose context carries the problem and
a hint (and, for checks spanning fields, the field path and its value); ``ddpkit.jobs.load``
turns it into one ``ConfigError`` line. Split from :mod:`ddpkit.jobs.spec` so that the sweep's
model (:mod:`ddpkit.jobs.sweep_spec`) uses the same pieces without an import cycle.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

__all__ = ["ERROR_TYPE", "Model", "invalid", "no_nul", "number_to_str", "stripped_hint"]

ERROR_TYPE = "ddpkit"


class Model(BaseModel):
    # strict: YAML already has types; no 'yes' -> 1 or '2' -> 2 guessing behind the user's back
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def invalid(
    problem: str, hint: str, *, field: str | None = None, value: object = ...
) -> PydanticCustomError:
    """A validation error ``ddpkit.jobs.load`` turns into ``<field>=<value>: <problem> (hint)``.

    ``field``/``value`` are for checks spanning fields (pydantic has no location for those).
    """
    ctx: dict[str, object] = {"problem": problem, "hint": hint}
    if field is not None:
        ctx["field"] = field
    if value is not ...:
        ctx["value"] = value
    return PydanticCustomError(ERROR_TYPE, "{problem}", ctx)


def no_nul(text: str) -> str:
    if "\x00" in text:
        raise invalid("contains a NUL character", "remove it: no shell or file name can hold it")
    return text


def number_to_str(value: object) -> object:
    """YAML reads ``4`` and ``0.1`` as numbers; where a string is meant, take their text."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def stripped_hint(key: str, pattern: re.Pattern[str]) -> str | None:
    """The hint for a key that is valid but for surrounding whitespace (a YAML block scalar or
    a copied line can carry a newline or a CR), else None."""
    if key != key.strip() and pattern.fullmatch(key.strip()):
        return f"write {key.strip()!r}, without the surrounding whitespace or line break"
    return None
