"""The "did you mean" of every error about a misspelt name (a flag value, a key, a backend).

One helper, so that every error says it the same way: the closest known name when there is
one, followed by the caller's own hint (the valid set or format).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "did_you_mean"]


def closest(value: str, choices: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The choice most like ``value`` (case-insensitively), or None when none is close."""
    listed = [str(choice) for choice in choices]
    by_lower = {choice.lower(): choice for choice in listed}
    found = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=cutoff)
    return by_lower[found[0]] if found else None


def did_you_mean(
    value: str, choices: Iterable[str], *, hint: str | None = None, cutoff: float = 0.6
) -> str:
    """``did you mean 'x'? (hint)`` when a choice is close, else the hint.

    Without ``hint`` the fallback lists the choices: ``choose 'a', 'b'``.
    """
    listed = [str(choice) for choice in choices]
    hint = hint or "choose " + ", ".join(repr(choice) for choice in listed)
    match = closest(value, listed, cutoff=cutoff)
    return f"did you mean {match!r}? ({hint})" if match else hint
