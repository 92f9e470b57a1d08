"""The one seam every SLURM command of ddpkit goes through: ``runner(argv, stdin=, env=)``.

:class:`Runner` is the protocol, :func:`subprocess_runner` the real one (``subprocess.run`` with
a timeout, a tool that cannot run as :class:`SlurmError`); tests hand in a fake and need
neither a cluster nor patching. No other module of ddpkit starts ``sbatch``, ``squeue``,
``sacct``, ``scontrol``, ``scancel`` or ``srun`` itself (tests/cluster/test_slurmtools_seam.py
checks). ``env=None`` means the caller's environment; nothing here writes ``os.environ``.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

from ddpkit.errors import SchedulerError

__all__ = [
    "COMMAND_TIMEOUT_S",
    "CommandResult",
    "Runner",
    "SlurmError",
    "first_line",
    "lines",
    "subprocess_runner",
]

COMMAND_TIMEOUT_S = 60.0


# The scheduler error of the package-wide tree, under the name this module's callers use.
SlurmError = SchedulerError


class CommandResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


class Runner(Protocol):
    """Runs ``argv`` with ``stdin`` text and the full environment ``env`` (None: inherit)."""

    def __call__(
        self, argv: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
    ) -> CommandResult: ...


def subprocess_runner(
    argv: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
) -> CommandResult:
    """The real :class:`Runner`: ``subprocess.run`` with a timeout; errors as SlurmError."""
    command = shlex.join(argv)
    try:
        done = subprocess.run(
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            env=None if env is None else dict(env),
            timeout=COMMAND_TIMEOUT_S,
            check=False,
            start_new_session=True,  # a terminal's Ctrl-C is ddpkit's to act on, not the tool's
        )
    except FileNotFoundError as exc:
        raise SlurmError(
            f"command {argv[0]!r} not found (running `{command}`)",
            hint="install SLURM's client tools (Debian: slurm-client) or put them on PATH",
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(
            f"`{command}` did not answer within {COMMAND_TIMEOUT_S:g} s",
            hint="is the controller up? `scontrol ping` tells",
        ) from exc
    except OSError as exc:  # not executable, too many open files: still the tool's failure
        raise SlurmError(
            f"`{command}` could not run: {exc}", hint="check the tool's permissions and PATH"
        ) from exc
    return CommandResult(done.returncode, done.stdout, done.stderr)


def lines(text: str) -> list[str]:
    """The non-empty lines of a tool's output, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def first_line(text: str) -> str:
    """The first non-empty line (a tool's message), or ``(no message)``."""
    return (lines(text) or ["(no message)"])[0]
