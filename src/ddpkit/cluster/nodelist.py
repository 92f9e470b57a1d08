"""SLURM's compact host and task lists: ``n[01-04,7],gpu-a[1-2]-ib`` and ``3,1(x2)``.

A small hand-written parser (no regex shortcut that finds only the first host, no scontrol):

* top level: a comma-separated list of items; commas inside brackets do not split;
* item: literal text and bracket groups, any number of each (``rack[1-2]-node[01-02]``); the
  hosts of an item are the cartesian product of its groups, leftmost group varying slowest;
* group: a comma-separated list of numbers and ``lo-hi`` ranges; a range keeps the width of
  its start, zero-padded (``[08-10]`` gives ``08 09 10``), as SLURM does.

Hosts come out in order, duplicates kept. ``first_host`` and ``count_hosts`` work on the
parsed form without expanding it, so a huge range costs nothing there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from ddpkit.errors import ConfigError, NodelistError

__all__ = [
    "MAX_EXPANDED_HOSTS",
    "count_hosts",
    "expand_nodelist",
    "expand_tasks_per_node",
    "first_host",
]

# Guards expand_nodelist against a typo like n[1-100000000] eating all memory.
MAX_EXPANDED_HOSTS = 1_000_000

_Range = tuple[int, int, int]  # lo, hi (inclusive), zero-padding width
_Segment = str | tuple[_Range, ...]  # literal text, or one bracket group
_Item = tuple[_Segment, ...]
_HINT = "use SLURM hostlist syntax, e.g. 'node[01-04,7],login1' (see `scontrol show hostnames`)"


class _Parser:
    """Parses one hostlist; every error quotes the whole input."""

    def __init__(self, text: str, source: str | None) -> None:
        self.text = text
        self.source = source

    def fail(self, problem: str) -> NodelistError:
        where = f"{self.source}={self.text!r}" if self.source else f"nodelist {self.text!r}"
        return NodelistError(f"{where} is malformed: {problem}", hint=_HINT)

    def items(self) -> list[_Item]:
        body = self.text.strip()
        if not body:
            raise self.fail("it is empty")
        return [self.item(raw.strip()) for raw in self.split_top_level(body)]

    def split_top_level(self, body: str) -> Iterator[str]:
        depth, start = 0, 0
        for index, char in enumerate(body):
            if char == "[":
                if depth:
                    raise self.fail(f"nested '[' at position {index}")
                depth = 1
            elif char == "]":
                if not depth:
                    raise self.fail(f"']' without a matching '[' at position {index}")
                depth = 0
            elif char == "," and not depth:
                yield body[start:index]
                start = index + 1
        if depth:
            raise self.fail("a '[' is never closed")
        yield body[start:]

    def item(self, raw: str) -> _Item:
        if not raw:
            raise self.fail("an empty item (two commas in a row, or a leading/trailing comma)")
        segments: list[_Segment] = []
        rest = raw
        while rest:
            head, bracket, tail = rest.partition("[")
            if any(char.isspace() for char in head):
                raise self.fail(f"whitespace inside the host name {raw!r}")
            if head:
                segments.append(head)
            if not bracket:
                break
            group, _, rest = tail.partition("]")
            segments.append(self.group(group))
        return tuple(segments)

    def group(self, group: str) -> tuple[_Range, ...]:
        if not group.strip():
            raise self.fail("empty brackets '[]'")
        return tuple(self.range(part.strip()) for part in group.split(","))

    def range(self, part: str) -> _Range:
        if not part:
            raise self.fail("an empty entry inside brackets")
        lo_text, dash, hi_text = part.partition("-")
        if dash and not hi_text:
            raise self.fail(f"the range {part!r} has no end")
        hi_text = hi_text if dash else lo_text
        for number in (lo_text, hi_text):
            if not (number.isascii() and number.isdigit()):
                raise self.fail(f"{part!r} inside brackets is not a number or a 'lo-hi' range")
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise self.fail(f"the range {part!r} is reversed (its end is below its start)")
        return lo, hi, len(lo_text)


def _range_values(ranges: tuple[_Range, ...]) -> Iterator[str]:
    for lo, hi, width in ranges:
        for value in range(lo, hi + 1):
            yield f"{value:0{width}d}"


def _item_size(item: _Item) -> int:
    return math.prod(
        sum(hi - lo + 1 for lo, hi, _ in segment)
        for segment in item
        if not isinstance(segment, str)
    )


def expand_nodelist(text: str, *, source: str | None = None) -> list[str]:
    """All hosts of a SLURM hostlist, in order, duplicates kept.

    ``source`` (e.g. ``"SLURM_STEP_NODELIST"``) names the variable in error messages.
    Raises :class:`NodelistError` for malformed input, quoting it and saying what is wrong.
    """
    parser = _Parser(text, source)
    items = parser.items()
    total = sum(_item_size(item) for item in items)
    if total > MAX_EXPANDED_HOSTS:
        raise parser.fail(f"it expands to {total} hosts (more than {MAX_EXPANDED_HOSTS})")
    hosts: list[str] = []
    for item in items:
        choices = [[seg] if isinstance(seg, str) else list(_range_values(seg)) for seg in item]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def first_host(text: str, *, source: str | None = None) -> str:
    """The first host of a SLURM hostlist, without expanding the rest."""
    first = _Parser(text, source).items()[0]
    return "".join(seg if isinstance(seg, str) else f"{seg[0][0]:0{seg[0][2]}d}" for seg in first)


def count_hosts(text: str, *, source: str | None = None) -> int:
    """How many hosts a SLURM hostlist names (duplicates counted), without expanding it."""
    return sum(_item_size(item) for item in _Parser(text, source).items())


def expand_tasks_per_node(text: str, *, source: str | None = None) -> list[int]:
    """SLURM's tasks-per-node layout as one count per node: ``"3,1(x2)"`` → ``[3, 1, 1]``.

    Raises :class:`ConfigError` (naming ``source`` when given) for malformed input.
    """
    where = f"{source}={text!r}" if source else f"tasks-per-node layout {text!r}"
    hint = "SLURM writes it as comma-separated counts with repeats, e.g. '4(x2),3'"
    counts: list[int] = []
    for raw in text.split(","):
        entry = raw.strip()
        count_text, paren, repeat_text = entry.partition("(x")
        if paren:
            if not repeat_text.endswith(")"):
                raise ConfigError(f"{where} is malformed: {entry!r} lacks ')'", hint=hint)
            repeat_text = repeat_text[:-1]
        else:
            repeat_text = "1"
        for number in (count_text, repeat_text):
            if not (number.isascii() and number.isdigit()):
                raise ConfigError(
                    f"{where} is malformed: {entry!r} is not 'N' or 'N(xM)'", hint=hint
                )
        if int(repeat_text) < 1:
            raise ConfigError(f"{where} is malformed: {entry!r} repeats zero times", hint=hint)
        counts.extend([int(count_text)] * int(repeat_text))
    return counts
