"""``fn(**values)`` as a picklable object: what :func:`ddpkit.jobs.map_function` submits per run.

Each array task imports this module to unpickle it before it can call ``fn``: it imports
nothing, so a task does not pay for YAML, Jinja2 and the spec's models first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["KeywordCall"]


class KeywordCall:
    """``fn(**kwargs)``, picklable, for submitit's ``map_array``."""

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, str]) -> None:
        self.fn = fn
        self.kwargs = kwargs

    def __call__(self) -> Any:
        return self.fn(**self.kwargs)
