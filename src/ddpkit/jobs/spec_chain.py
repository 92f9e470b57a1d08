"""The spec's chain and console fields: ``after``/``after_type``/``singleton`` (SLURM job
dependencies) and ``log_ranks`` (which local ranks a node's console output shows).

A chain is one flat list with one type (``after: [prep, 1234]``, ``after_type: afterok``), as
sbatch writes it (``--dependency=afterok:1:2``) and ``--set after=[prep]`` says it in one word.
Each value is a job id (ASCII digits, ``_N`` for an array task) or a job name, so none can add
an option or a line to the script; names become ids at submission (:mod:`ddpkit.jobs.chain`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator

from ddpkit.errors import ConfigError
from ddpkit.jobs.spec_checks import MAX_PER_NODE, invalid, number_to_str, shown

__all__ = [
    "CHAIN_DOCS",
    "AfterList",
    "AfterType",
    "LogRanks",
    "check_log_ranks",
    "dependency",
    "is_dependency_id",
    "ranks_filter",
]

AfterType = Literal["afterok", "afterany"]
MAX_AFTER = 100  # jobs one job may wait for: far above any real chain
# the fields' descriptions: documentation, and the hint for a value of the wrong type
CHAIN_DOCS = {
    "after": "jobs this one waits for: names or SLURM job ids, e.g. after: [prep] (sbatch, "
    "submitit)",
    "after_type": "afterok (default: start once all ended COMPLETED) or afterany (once all ended)",
    "singleton": "true: one job of this name (and user) at a time, e.g. singleton: true",
    "log_ranks": "launch: torchrun: the local ranks whose output each node prints (torchrun's "
    "--local-ranks-filter), e.g. log_ranks: [0]; null: all",
}

# [0-9], not \d: \d takes every script's digits, which SLURM would not know
_DEPENDENCY_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")
# a name as ``name:`` allows it, but not starting with '-' (it goes to squeue's argv too)
_JOB_NAME = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")
_AFTER_EXAMPLE = "e.g. after: [prep] (a job name) or after: [1234] (a job id; 1234_5: a task)"


def is_dependency_id(text: str) -> bool:
    """Whether ``text`` is a SLURM job id sbatch's ``--dependency`` takes (``123``, ``123_4``)."""
    return _DEPENDENCY_ID.fullmatch(text) is not None


def _as_list(value: object) -> object:
    if isinstance(value, str | int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, list | tuple):
        return [number_to_str(item) for item in value]
    return value


def _check_refs(refs: list[str]) -> list[str]:
    if len(refs) > MAX_AFTER:
        raise invalid(f"names {len(refs)} jobs, more than {MAX_AFTER}", "a typo?")
    for ref in refs:
        if is_dependency_id(ref):
            continue
        if ref[:1].isdigit() or not _JOB_NAME.fullmatch(ref):
            raise invalid(
                f"has {shown(ref)}, neither a SLURM job id nor a job name",
                _AFTER_EXAMPLE,
            )
    if len(set(refs)) != len(refs):
        twice = next(ref for ref in refs if refs.count(ref) > 1)
        raise invalid(f"names {shown(twice)} twice", "give each job once")
    return refs


def _check_log_ranks(ranks: list[int]) -> list[int]:
    if not ranks:
        raise invalid("is empty: no rank would print", "e.g. log_ranks: [0]; null shows all")
    if len(set(ranks)) != len(ranks):
        raise invalid("names a rank twice", f"e.g. log_ranks: {sorted(set(ranks))}")
    return sorted(ranks)


def _rank_in_range(rank: int) -> int:
    if not 0 <= rank < MAX_PER_NODE:
        raise invalid(
            f"has {rank}, not a local rank (0..{MAX_PER_NODE - 1})",
            "local ranks count from 0 on each node, e.g. log_ranks: [0]",
        )
    return rank


AfterList = Annotated[list[str], BeforeValidator(_as_list), AfterValidator(_check_refs)]
LogRanks = Annotated[
    list[Annotated[int, AfterValidator(_rank_in_range)]],
    AfterValidator(_check_log_ranks),
]


def check_log_ranks(ranks: Sequence[int], launch: str, procs: int) -> None:
    """``log_ranks`` against the layout: torchrun's filter is the one way to carry it (under
    ``launch: srun`` each rank writes its own file already, and nothing prints N copies), and
    a rank beyond the node's processes would print nothing at all."""
    if launch != "torchrun":
        raise invalid(
            "is for launch: torchrun (torchrun's --local-ranks-filter); under launch: srun "
            "each rank writes its own file (<name>-<id>-rank<N>.out), so none is printed twice",
            "drop log_ranks, or set launch: torchrun",
            field="log_ranks",
            value=list(ranks),
        )
    beyond = [rank for rank in ranks if rank >= procs]
    if beyond:
        raise invalid(
            f"has local rank {beyond[0]}, but a node runs {procs} processes (0..{procs - 1})",
            "e.g. log_ranks: [0]",
            field="log_ranks",
            value=list(ranks),
        )


def dependency(ids: Sequence[str], after_type: AfterType, singleton: bool) -> str | None:
    """sbatch's ``--dependency`` value: ``afterok:1:2``, ``singleton`` or both joined by ``,``
    (SLURM: all must hold); None for no dependency. Only job ids: the backends resolve names
    first (:func:`ddpkit.jobs.chain.resolve_after`); one left is a ConfigError."""
    parts = []
    names = [ref for ref in ids if not is_dependency_id(ref)]
    if names:
        raise ConfigError(
            f"after={names!r}: job names are resolved to job ids at submission",
            hint="render through ddpkit.jobs.api (dry_run, submit), or give job ids",
        )
    if ids:
        parts.append(":".join([after_type, *ids]))
    if singleton:
        parts.append("singleton")
    return ",".join(parts) or None


def ranks_filter(log_ranks: Sequence[int] | None) -> list[str]:
    """torchrun's ``--local-ranks-filter`` for ``log_ranks`` (none for null): only those local
    ranks' lines reach the node's output (every rank's own log stays in torchrun's log dir)."""
    if log_ranks is None:
        return []
    return ["--local-ranks-filter", ",".join(map(str, log_ranks))]
