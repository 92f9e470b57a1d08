"""What a test needs from the machine. Missing, it fails under CI=true (the test command
installs everything: a missing piece there is the command's bug, not a reason to skip) and is
skipped elsewhere, saying why."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def missing(why: str) -> NoReturn:
    """Fail under CI=true, else skip (at module level too), with ``why``."""
    if on_ci():
        pytest.fail(why, pytrace=False)
    pytest.skip(why, allow_module_level=True)


def module(name: str) -> ModuleType:
    """``import name``, or :func:`missing` naming it (the dev extra installs every optional one)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"{name} cannot be imported ({exc}): pip install -e .[dev] installs it")
