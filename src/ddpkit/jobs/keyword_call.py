"""``fn(**values)`` as a picklable object: what :func:`ddpkit.jobs.map_function` submits per run.

Each task of the array unpickles it before it can call ``fn``, and unpickling imports the
module that defines its class: this one imports nothing, so a task starts as fast as one of
submitit's own ``map_array`` (defined in the submitit backend, the class cost every task
0.2 s of importing YAML, Jinja2 and the spec's models before the function ran).
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
