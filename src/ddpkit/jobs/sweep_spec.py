"""The ``sweep:`` section of a job spec: its pydantic model and every check on it.

Each name becomes ``DDPKIT_SWEEP_<NAME>``, so names equal but for case are refused, as are
ddpkit's own (``task``, ``run``, ``sweep_task``, ``sweep_run``). The arithmetic (tasks, run
names, placeholders) is :mod:`ddpkit.jobs.sweep`'s.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from ddpkit.hints import did_you_mean
from ddpkit.jobs import sweep as sweeps
from ddpkit.jobs.spec_checks import Model, invalid, no_nul, number_to_str, shown, stripped_hint

__all__ = [
    "MAX_SWEEP_TASKS",
    "SHARED_RUN_ID",
    "SHARED_RUN_ID_HINT",
    "SWEEP_DESCRIPTION",
    "Sweep",
    "check_placeholders",
    "unused_parameters",
]

# A DDPKIT_RUN_ID given to a whole sweep (its spec's env, or the submitting environment, which
# sbatch hands on) would name every task alike: refused, each task keeps SLURM's own run id.
SHARED_RUN_ID = "would be the run id of every task of the sweep (one tracker run for all of them)"
SHARED_RUN_ID_HINT = "each task is its own run, slurm-<array id>_<task>"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SWEEP_DESCRIPTION = "runs of the command, e.g. sweep: {params: {lr: [0.1, 0.01], seed: [1, 2]}}"
_D_PARAMS = "parameter names and their lists of values, e.g. params: {lr: [0.1, 0.01]}"
_D_MODE = "grid (every combination, the default) or zip (the i-th values together)"
_D_PARALLEL = "how many runs SLURM may run at once (--array=...%N), e.g. max_parallel: 4"
# ddpkit's own limit: the batch script carries a line per task, and sbatch refuses scripts over
# 4 MB by default; SLURM's MaxArraySize (checked at submission) is usually far lower.
MAX_SWEEP_TASKS = 100_000


def _check_sweep_name(name: str) -> str:
    if not name.isidentifier() or not name.isascii():
        fixed = re.sub(r"\W", "_", name.strip(), flags=re.ASCII)
        fixed = fixed if fixed.isidentifier() else "p_" + fixed
        raise invalid(
            "is not a parameter name",
            stripped_hint(name, _NAME)
            or f"letters, digits and '_', not starting with a digit, e.g. {shown(fixed)}",
        )
    if name in sweeps.BUILTIN_PLACEHOLDERS or name.upper() in ("TASK", "RUN"):
        raise invalid(
            "is a name ddpkit uses itself (DDPKIT_SWEEP_TASK/RUN, {sweep_task}/{sweep_run})",
            "rename the parameter, e.g. " + shown(name + "_"),
        )
    return name


def _check_sweep_value(value: str) -> str:
    no_nul(value)
    if "".join(value.splitlines()) != value:
        raise invalid("contains a line break", "a sweep value is one line (it names a folder)")
    if not value.strip():
        raise invalid("is empty", "give every value some text, e.g. lr: [0.1, 0.01]")
    return value


def _check_sweep_values(values: list[str]) -> list[str]:
    if not values:
        raise invalid("is an empty list: the sweep would have no runs", "e.g. lr: [0.1, 0.01]")
    return values


SweepParams = dict[
    Annotated[str, AfterValidator(_check_sweep_name)],
    Annotated[
        list[Annotated[str, BeforeValidator(number_to_str), AfterValidator(_check_sweep_value)]],
        AfterValidator(_check_sweep_values),
    ],
]


class Sweep(Model):
    """Many runs of one job: named parameters with lists of values, one SLURM array task each.

    ``grid`` runs every combination (the first parameter varies slowest), ``zip`` the i-th
    value of every list together. See :mod:`ddpkit.jobs.sweep` for run names and placeholders.
    """

    params: SweepParams = Field(description=_D_PARAMS)
    mode: sweeps.Mode = Field("grid", description=_D_MODE)
    max_parallel: int | None = Field(None, ge=1, le=MAX_SWEEP_TASKS, description=_D_PARALLEL)

    @model_validator(mode="after")
    def _check_runs(self) -> Sweep:
        if not self.params:
            hint = "e.g. params: {lr: [0.1, 0.01]}"
            raise invalid("has no parameters", hint, field="sweep.params", value={})
        by_var: dict[str, str] = {}
        for name in self.params:
            other = by_var.setdefault(sweeps.value_var(name), name)
            if other != name:
                raise invalid(
                    f"and {shown(other)} would both be "
                    f"{shown(sweeps.value_var(name), quote=False)}",
                    "give parameters names that differ in more than case",
                    field="sweep.params",
                    value=name,
                )
        count = self.count
        if count > MAX_SWEEP_TASKS:
            raise invalid(
                f"makes {count} runs, more than ddpkit's limit of {MAX_SWEEP_TASKS}",
                "split the sweep into several submissions",
                field="sweep.params",
                value={name: len(values) for name, values in self.params.items()},
            )
        try:
            sweeps.expand(self.params, self.mode)
        except ValueError as exc:
            raise invalid(
                shown(str(exc), quote=False),
                "give every list the same length, or use mode: grid"
                if self.mode == "zip" and "length" in str(exc)
                else "remove the repeated value",
                field="sweep.params",
                value={name: list(values) for name, values in self.params.items()},
            ) from None
        return self

    @property
    def count(self) -> int:
        """How many runs (array tasks) the sweep has."""
        lengths = [len(values) for values in self.params.values()]
        return min(lengths, default=0) if self.mode == "zip" else math.prod(lengths)

    @property
    def tasks(self) -> list[sweeps.SweepTask]:
        """Every run: its array index, values and run name."""
        return sweeps.tasks(self.params, self.mode)


def check_placeholders(command: list[str], sweep: Sweep) -> None:
    """Every ``{name}`` in the command must be a parameter of ``sweep`` or a built-in (without
    a sweep, braces are the command's own business and this is not called)."""
    known = [*sweep.params, *sweeps.BUILTIN_PLACEHOLDERS]
    for word in command:
        try:
            names = sweeps.placeholders(word)
        except ValueError as exc:
            raise invalid(
                shown(str(exc), quote=False),
                "see Sweeps in the README",
                field="command",
                value=word,
            ) from None
        for name in names:
            if name not in known:
                raise invalid(
                    f"has the placeholder {{{name}}}, which is not a sweep parameter",
                    did_you_mean(name, known, hint="known: " + ", ".join(known)),
                    field="command",
                    value=word,
                )


def unused_parameters(command: list[str], sweep: Sweep) -> list[str]:
    """The sweep's parameters that no ``{name}`` of the command uses: they reach the ranks only
    as ``DDPKIT_SWEEP_<NAME>``, so unless the script reads that variable every run of the
    sweep is the same run (call after :func:`check_placeholders`)."""
    used = {name for word in command for name in sweeps.placeholders(word)}
    return [name for name in sweep.params if name not in used]
