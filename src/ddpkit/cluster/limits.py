"""The open-files limit a rank needs for its job's size, and raising it where the system allows.

A rank holds a socket per peer (gloo's full mesh) and its store connections; the store's host
also one accepted connection per store connection of every rank. A big job needs more than the
soft limit many systems give (1,024) and then fails at start-up with ``EMFILE`` ("Too many open
files") on one rank, far from the cause. Any process may raise its own soft limit up to the
hard one: ``ddpkit.init`` (before it makes or joins the store) and ``ddpkit run`` (its agent may
host the store) do so only when and as far as the job needs, so a program that still uses
``select()`` keeps descriptors under 1,024 in every job that fitted before. Under plain
torchrun, whose agent hosts the store, rank 0 reads the agent's limit (:func:`open_files_of`)
and warns when it is short. ``ddpkit doctor`` checks the same rule. Stdlib only.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

__all__ = [
    "ASK_ADMINS",
    "SPARE_FILES",
    "STORE_CONNECTIONS_PER_RANK",
    "OpenFiles",
    "launcher_shortfall",
    "open_files",
    "open_files_needed",
    "open_files_of",
    "raise_open_files",
]

# Connections each rank keeps open to the rendezvous store: the group's client and the
# watchdog's clone (benchmarks/bench_scale.py counts them; a probe, closed at once, only when
# the client lingers).
STORE_CONNECTIONS_PER_RANK = 2
# Descriptors a rank needs besides the job's sockets: Python, torch's libraries, log files,
# data loader pipes.
SPARE_FILES = 256
_UNLIMITED_AS = 2**31  # how an unlimited limit is compared and shown
# The fix for a hard limit below the need (only root raises one)
ASK_ADMINS = (
    "ask the admins to raise it (limits.conf, or SLURM's PropagateResourceLimits from the "
    "submitting shell)"
)


def open_files_needed(world_size: int, hosts_store: bool) -> int:
    """Descriptors one rank needs: a socket per peer (gloo's full mesh; NCCL's bootstrap
    ring needs fewer), its own store connections, the spare, and on the store's host one
    accepted connection per store connection of every rank."""
    own = (world_size - 1) + STORE_CONNECTIONS_PER_RANK + SPARE_FILES
    return own + (STORE_CONNECTIONS_PER_RANK * world_size if hosts_store else 0)


@dataclass(frozen=True)
class OpenFiles:
    """This process's open-files limits around :func:`raise_open_files` (unlimited: 2**31)."""

    need: int
    before: int  # the soft limit found
    soft: int  # the soft limit now
    hard: int

    @property
    def short(self) -> bool:
        """The soft limit is still below the need: the hard limit (or the system) stopped it."""
        return self.soft < self.need

    def warning(self, world_size: int) -> str:
        """One line for a rank whose limit stays short."""
        return (
            f"ddpkit: ulimit -n is {self.soft}, and {world_size} ranks need {self.need} open "
            f"files here (a socket per peer, {STORE_CONNECTIONS_PER_RANK} store connections "
            f"a rank, {SPARE_FILES} spare): the hard limit {self.hard} stops ddpkit from raising "
            f"it; expect 'Too many open files': {ASK_ADMINS}; `ddpkit doctor` checks it"
        )


def _finite(value: int) -> int:
    return _UNLIMITED_AS if value == resource.RLIM_INFINITY else value


def open_files() -> tuple[int, int]:
    """This process's open-files limits (soft, hard; unlimited: 2**31)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _finite(soft), _finite(hard)


def raise_open_files(need: int) -> OpenFiles:
    """Raise this process's soft open-files limit to ``need`` when it is lower, as far as the
    hard limit allows. Never lowers a limit; a refusal (a container's seccomp, say) leaves it
    as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before, ceiling = _finite(soft), _finite(hard)
    if before >= need:
        return OpenFiles(need, before, before, ceiling)
    target = min(need, ceiling)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):
        return OpenFiles(need, before, before, ceiling)
    return OpenFiles(need, before, open_files()[0], ceiling)


def open_files_of(pid: int) -> tuple[int, int] | None:
    """Another process's open-files limits (soft, hard; unlimited: 2**31), read with
    ``prlimit`` (Linux); None where it cannot be read (another user's process, gone, no
    ``prlimit``). Nothing is changed."""
    prlimit = getattr(resource, "prlimit", None)
    if prlimit is None:
        return None
    try:
        soft, hard = prlimit(pid, resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None
    return _finite(soft), _finite(hard)


def launcher_shortfall(world_size: int, pid: int, soft: int, hard: int) -> tuple[str, str] | None:
    """When the launcher ``pid`` hosts the job's store (torchrun's agent, rank 0's parent) with
    the open-files limits ``soft``/``hard`` (read with :func:`open_files_of`), below a store
    host's need: (what is short, the fix), for ``ddpkit.init``'s warning and ``ddpkit doctor``'s
    line; None when it fits. ddpkit cannot raise another process's limit."""
    need = open_files_needed(world_size, hosts_store=True)
    if soft >= need:
        return None
    what = (
        f"the launcher (pid {pid}) hosts the job's store with ulimit -n {soft} < {need} "
        f"({world_size} ranks, {STORE_CONNECTIONS_PER_RANK} store connections each)"
    )
    fix = (
        f"`ulimit -n {need}` before torchrun, or launch with `ddpkit run` (it raises its own)"
        if hard >= need
        else f"its hard limit is {hard}: {ASK_ADMINS}"
    )
    return what, fix
