"""Sweeps: many runs from one spec, one SLURM array task per combination of values.

The arithmetic of a sweep, pure and stdlib-only (the job contract and the renderer import
it): its tasks (``grid``: every combination, the first parameter slowest; ``zip``: the i-th
values together), each task's run name, and the command's ``{name}`` placeholders.

Run names (``lr=0.1,seed=1``) come from the values alone, so a requeued task finds its folders
again; where two would clash once cleaned (``a/b``, ``a_b``), each gets a hash of its values.
Placeholders are plain ``{name}`` (``{{``/``}}``: braces): no format specs or conversions, as
a value is substituted as the text it is. Checks raise ``ValueError``; the spec validates.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ddpkit.contract import SWEEP_VAR_PREFIX

__all__ = [
    "BUILTIN_PLACEHOLDERS",
    "RUN_PLACEHOLDER",
    "TASK_PLACEHOLDER",
    "Mode",
    "SweepTask",
    "expand",
    "placeholders",
    "run_names",
    "split_word",
    "substitute",
    "value_var",
]

Mode = Literal["grid", "zip"]
TASK_PLACEHOLDER = "sweep_task"
RUN_PLACEHOLDER = "sweep_run"
BUILTIN_PLACEHOLDERS = (TASK_PLACEHOLDER, RUN_PLACEHOLDER)
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=,-]")
_MAX_NAME = 96
_FORMATTER = string.Formatter()


@dataclass(frozen=True)
class SweepTask:
    """One run of a sweep: its array index, its values (parameter -> text) and folder name."""

    index: int
    values: Mapping[str, str]
    run: str

    def placeholder_values(self) -> dict[str, str]:
        """What each placeholder stands for in this task (its values and the two built-ins)."""
        return {**self.values, TASK_PLACEHOLDER: str(self.index), RUN_PLACEHOLDER: self.run}


def value_var(name: str) -> str:
    """The environment variable carrying parameter ``name``'s value: ``DDPKIT_SWEEP_LR``."""
    return SWEEP_VAR_PREFIX + name.upper()


def expand(params: Mapping[str, Sequence[str]], mode: Mode) -> list[dict[str, str]]:
    """The value combinations of a sweep, in task order; ``ValueError`` for zip lists of
    unequal lengths or a combination that comes twice."""
    names = list(params)
    if mode == "zip":
        lengths = {name: len(params[name]) for name in names}
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"{name}: {n}" for name, n in lengths.items())
            raise ValueError(f"zip needs lists of one length, these have {shown}")
        rows: Iterable[tuple[str, ...]] = zip(*(params[name] for name in names), strict=True)
    else:
        rows = itertools.product(*(params[name] for name in names))
    combos = [dict(zip(names, row, strict=True)) for row in rows]
    seen: dict[tuple[str, ...], int] = {}
    for index, combo in enumerate(combos):
        key = tuple(combo.values())
        if key in seen:
            raise ValueError(f"tasks {seen[key]} and {index} would both run {_pairs(combo)}")
        seen[key] = index
    return combos


def _pairs(values: Mapping[str, str]) -> str:
    return ",".join(f"{name}={value}" for name, value in values.items())


def _digest(values: Mapping[str, str]) -> str:
    text = "\x1f".join(f"{name}\x1e{value}" for name, value in values.items())
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


def run_names(combos: Sequence[Mapping[str, str]]) -> list[str]:
    """A folder name per combination, derived from its values only; unique within the sweep."""
    plain = [_UNSAFE.sub("_", _pairs(combo))[:_MAX_NAME] or "run" for combo in combos]
    counts: dict[str, int] = {}
    for name in plain:
        counts[name] = counts.get(name, 0) + 1
    return [
        f"{name}-{_digest(combo)}" if counts[name] > 1 else name
        for name, combo in zip(plain, combos, strict=True)
    ]


def tasks(params: Mapping[str, Sequence[str]], mode: Mode) -> list[SweepTask]:
    """Every task of a sweep: index, values and run name."""
    combos = expand(params, mode)
    return [
        SweepTask(index, combo, run)
        for index, (combo, run) in enumerate(zip(combos, run_names(combos), strict=True))
    ]


def split_word(word: str) -> list[tuple[str, str | None]]:
    """``"--lr={lr}x"`` -> ``[("--lr=", "lr"), ("x", None)]``: literal text, then the
    placeholder that follows it (None at the end). ``ValueError`` for what is not a plain
    ``{name}`` (a format spec, a conversion, an unmatched brace)."""
    try:
        parsed = list(_FORMATTER.parse(word))
    except ValueError as exc:
        raise ValueError(f"{exc} (write {{{{ and }}}} for literal braces)") from None
    parts: list[tuple[str, str | None]] = []
    for literal, name, spec, conversion in parsed:
        if name is not None and (spec or conversion or not name.isidentifier()):
            tail = (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            shown = f"{{{name}{tail}}}"
            raise ValueError(
                f"{shown} is not a plain placeholder: write {{name}} (values are substituted "
                "as they are), or {{ and }} for literal braces"
            )
        parts.append((literal, name))
    return parts


def placeholders(word: str) -> list[str]:
    """The placeholder names in ``word``, in order (``ValueError`` as :func:`split_word`)."""
    return [name for _, name in split_word(word) if name is not None]


def substitute(word: str, values: Mapping[str, str]) -> str:
    """``word`` with each placeholder replaced by its value (``KeyError`` for an unknown one)."""
    parts = split_word(word)
    return "".join(literal + ("" if name is None else values[name]) for literal, name in parts)
