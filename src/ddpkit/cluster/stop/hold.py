"""``python -m ddpkit.cluster.stop.hold COMMAND [ARGS...]``: run a command under the stop
signal's hold-and-forward (:mod:`.forward`), and outlive it.

Each srun task of an sbatch job runs its command through this, and submitit's task runner
calls :func:`run_holding`. ``scancel --signal=USR2 <job>`` signals every process of the step at
once, the command's Python too, which would die of it before ``ddpkit.init()`` latched it: the
command starts with the signal blocked, so it stays pending until the latch.

As a task wrapper it outlives the command: SLURM's SIGTERM (scancel, requeue) and a terminal's
INT/HUP/QUIT reach the command too, and a task whose first process has ended is over for SLURM,
which then kills the rest (unwritten output included); so they are caught here, and the
command (whose handlers start at their defaults) decides. Exit code: the command's, 128+N when a
signal N ended it (as a shell reports it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import FrameType

from ddpkit.cluster.stop import forward
from ddpkit.cluster.stop.signals import stop_signal

__all__ = ["main", "run_holding"]

# ended by SLURM or a terminal: the command's to act on, not the wrapper's (which outlives it)
_OUTLIVED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def run_holding(
    command: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[int, bool]:
    """Run ``command`` (``env`` added to this process's environment) with the stop signal that
    ``DDPKIT_SIGNAL`` names held and forwarded to it; its return code (as ``subprocess`` gives
    it) and whether a stop signal came meanwhile."""
    stop = stop_signal(os.environ)
    forward.block(stop)
    forward.start(stop)
    before = forward.arrivals()
    child = subprocess.Popen(list(command), cwd=cwd, env={**os.environ, **env} if env else None)
    code = child.wait()
    return code, forward.arrivals() > before


def _ignore(signum: int, frame: FrameType | None) -> None:
    """A handler, not SIG_IGN: a handler is reset to the default in the command at exec."""


def main(argv: Sequence[str] | None = None) -> int:
    """The task wrapper: hold, run ``argv``, outlive it; its exit code."""
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print("usage: python -m ddpkit.cluster.stop.hold COMMAND [ARGS...]", file=sys.stderr)
        return 2
    for name in _OUTLIVED:
        signal.signal(getattr(signal, name), _ignore)
    code, _ = run_holding(command)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    raise SystemExit(main())
