"""The exceptions ddpkit raises, in one small tree.

    DdpkitError                      base of everything ddpkit raises on purpose
    ├── ConfigError (ValueError)     bad input: a flag, an environment variable, a spec field
    │   └── NodelistError            a SLURM hostlist that cannot be expanded
    ├── TopologyError (ValueError)   the environment describes an impossible or inconsistent job
    ├── RendezvousError              the master cannot be reached / the process group cannot form
    ├── SchedulerError (RuntimeError) a scheduler command (sbatch, squeue, sacct, scancel) failed
    ├── CheckpointError (RuntimeError) a checkpoint could not be saved or restored (every rank)
    └── UsageError (RuntimeError)    an API called in the wrong order (e.g. wrap() before init())

Every message names the offending field or variable and its value, and ends with a hint.
The CLI prints ``ddpkit: error: <message>`` for any ``DdpkitError`` and exits with code 2
(bad input) without a traceback.
"""

from __future__ import annotations

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

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message} (hint: {hint})" if hint else message)


class ConfigError(DdpkitError, ValueError):
    """A user-supplied value (flag, environment variable, spec field) is invalid."""


class NodelistError(ConfigError):
    """A SLURM hostlist expression is malformed; the message quotes the input."""


class TopologyError(DdpkitError, ValueError):
    """The launcher's variables contradict each other (ranks, world size, GPUs)."""


class RendezvousError(DdpkitError, RuntimeError):
    """The process group could not form: master unreachable, peers missing."""


class SchedulerError(DdpkitError, RuntimeError):
    """A scheduler command failed or answered something unusable; the message quotes both."""


class UsageError(DdpkitError, RuntimeError):
    """ddpkit's API was called in an order it does not support."""


class CheckpointError(DdpkitError, RuntimeError):
    """A checkpoint could not be saved or restored; raised on every rank, naming the cause."""
