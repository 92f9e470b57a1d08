"""``ddpkit.jobs.submitit_backend.RunCommand``: the old path of submitit's task runner.

Kept for unpickling only: a requeued job submitted before the move unpickles its task runner
from here. The runner lives in :mod:`ddpkit.launch.submitit_task` (above jobs/: found through
the module path the contract names, not imported).
"""

from __future__ import annotations

import importlib
from typing import Any

from ddpkit.contract import SUBMITIT_TASK_MODULE

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    """``RunCommand`` at its old path: a job submitted before the move unpickles it from here."""
    if name == "RunCommand":
        return importlib.import_module(SUBMITIT_TASK_MODULE).RunCommand
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
