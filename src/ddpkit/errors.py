"""The exceptions ddpkit raises, in one small tree.

    class                                 exit  what went wrong
    DdpkitError                              1  base of everything ddpkit raises on purpose
    ├── ConfigError (ValueError)             2  bad input: a flag, a variable, a spec field
    │   └── NodelistError                    2  a SLURM hostlist that cannot be expanded
    ├── TopologyError (ValueError)           2  the environment describes an impossible job
    ├── RendezvousError                      3  the master cannot be reached / no group forms
    ├── SchedulerError (RuntimeError)        4  sbatch, squeue, sacct, scancel, scontrol failed
    ├── CheckpointError (RuntimeError)       1  a checkpoint could not be saved or restored
    └── UsageError (RuntimeError)            1  an API called in the wrong order

Every message names the offending field or variable and its value, and ends with a hint.
The CLI prints ``ddpkit: error: <message>`` for any ``DdpkitError`` on one line, without a
traceback, and exits with the class's :attr:`~DdpkitError.exit_code` (the column above): 2
only for bad input, so a script can tell "fix the command" (2) from "the rendezvous failed"
(3, retry or check the network) and "the scheduler refused or is down" (4).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DdpkitError",
    "NodelistError",
    "RendezvousError",
    "SchedulerError",
    "TopologyError",
    "UsageError",
]


class DdpkitError(Exception):
    """Base class of the errors ddpkit raises on purpose."""

    exit_code: ClassVar[int] = 1  # the CLI's exit status for this class (table above)

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message} (hint: {hint})" if hint else message)


class ConfigError(DdpkitError, ValueError):
    """A user-supplied value (flag, environment variable, spec field) is invalid."""

    exit_code: ClassVar[int] = 2


class NodelistError(ConfigError):
    """A SLURM hostlist expression is malformed; the message quotes the input."""


class TopologyError(DdpkitError, ValueError):
    """The launcher's variables contradict each other (ranks, world size, GPUs)."""

    exit_code: ClassVar[int] = 2


class RendezvousError(DdpkitError, RuntimeError):
    """The process group could not form: master unreachable, peers missing."""

    exit_code: ClassVar[int] = 3


class SchedulerError(DdpkitError, RuntimeError):
    """A scheduler command failed or answered something unusable; the message quotes both."""

    exit_code: ClassVar[int] = 4


class UsageError(DdpkitError, RuntimeError):
    """ddpkit's API was called in an order it does not support."""


class CheckpointError(DdpkitError, RuntimeError):
    """A checkpoint could not be saved or restored; raised on every rank, naming the cause."""
