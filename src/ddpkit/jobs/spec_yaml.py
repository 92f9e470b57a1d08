"""The YAML of job specs, profiles and ``--set`` values: read safely, in bounded time and memory.

A spec may come from anywhere, so reading one must end soon, in little memory, with the
one-line error. On top of ``yaml.SafeLoader`` (no arbitrary objects, but unbounded) this refuses:

- a file over :data:`MAX_YAML_BYTES` (read no further, so ``/dev/zero`` ends too);
- more than :data:`MAX_YAML_NODES` values, aliases counted as what they expand to (a "billion
  laughs" is refused at the alias that passes the limit, before anything is built);
- nesting deeper than :data:`MAX_YAML_DEPTH`, and an alias inside the node it names;
- a key given twice (plain YAML keeps the last one), and a list or mapping as a key;
- values its constructors fail on with Python errors (``2024-13-45``, ``!!float abc``).

``12_3`` stays text, where YAML 1.1 reads 123: ``after: [12_3]`` names an array task. Every
refusal is a ``yaml.YAMLError`` with the position, turned into a short ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from ddpkit.errors import ConfigError
from ddpkit.jobs.spec_checks import shown

__all__ = [
    "MAX_YAML_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "SpecLoader",
    "parse_yaml_value",
    "read_yaml_mapping",
]

MAX_YAML_BYTES = 2**20
MAX_YAML_NODES = 100_000  # a spec has tens; a long sweep, thousands
MAX_YAML_DEPTH = 32  # a spec nests 4 deep (sweep.params.lr[0])
_SYNTAX_HINT = "check indentation and quoting there; quote values containing ': ' or ' #'"
_NODES_HINT = (
    f"a spec or profile is a few fields: at most {MAX_YAML_NODES} values, an alias counting as "
    "what it repeats; split a large sweep into several submissions"
)
_DEPTH_HINT = f"a spec nests a few levels (sweep.params.lr[0]), at most {MAX_YAML_DEPTH}"
_SIZE_HINT = "a spec or profile is a few fields: is it the right file?"


class _InputError(yaml.MarkedYAMLError):
    """A refusal of this loader; ``hint`` says what to do instead."""

    hint = _SYNTAX_HINT

    def __init__(self, problem: str, mark: Any, hint: str | None = None) -> None:
        super().__init__(None, None, problem, mark)
        if hint is not None:
            self.hint = hint


class SpecLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the bounds and checks of the module."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._expanded = 0  # values so far, aliases expanded
        self._sizes: dict[int, int] = {}  # id(node) -> its values, aliases expanded

    def _count(self, values: int, mark: Any) -> None:
        self._expanded += values
        if self._expanded > MAX_YAML_NODES:
            problem = f"more than {MAX_YAML_NODES} values (aliases expanded)"
            raise _InputError(problem, mark, _NODES_HINT)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None:
                if id(target) not in self._sizes:
                    problem = f"the alias *{shown(event.anchor, 40, quote=False)} is inside "
                    raise _InputError(problem + "the node it names", event.start_mark)
                self._count(self._sizes[id(target)], event.start_mark)
            return super().compose_node(parent, index)  # an undefined alias: its error
        if self._depth >= MAX_YAML_DEPTH:
            raise _InputError(
                f"nested more than {MAX_YAML_DEPTH} deep", event.start_mark, _DEPTH_HINT
            )
        before = self._expanded
        self._count(1, event.start_mark)
        self._depth += 1
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._sizes[id(node)] = self._expanded - before
        return node

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            what = str(node.tag).rpartition(":")[2] or "value"
            raise _InputError(
                f"cannot read this {what}: {shown(str(exc), 120, quote=False)}",
                node.start_mark,
                "write it as plain text in quotes, or fix the value",
            ) from None


def _construct_mapping(loader: SpecLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[object] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, Hashable):
            raise _InputError(
                f"a {type(key).__name__} is used as a mapping key",
                key_node.start_mark,
                "a key is a plain name, e.g. nodes: 2 (a '?' line starts a complex key)",
            )
        if key in seen:
            raise _InputError(
                f"key {shown(key, 80)} appears twice",
                key_node.start_mark,
                "give each key once; the later one would silently win",
            )
        seen.add(key)
    return loader.construct_mapping(node)


SpecLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _construct_int(loader: SpecLoader, node: yaml.ScalarNode) -> object:
    text = loader.construct_scalar(node)
    if isinstance(text, str) and "_" in text:
        return text  # 12_3: an array task's id, not YAML 1.1's 123
    return yaml.SafeLoader.construct_yaml_int(loader, node)


SpecLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _load(text: str) -> object:
    """``text`` through :class:`SpecLoader`; RecursionError is a last resort: it cannot come."""
    try:
        return yaml.load(text, Loader=SpecLoader)  # a SafeLoader: no arbitrary objects
    except RecursionError:
        raise _InputError(f"nested more than {MAX_YAML_DEPTH} deep", None, _DEPTH_HINT) from None


def _problem(exc: yaml.YAMLError) -> tuple[str, str, str]:
    """(``line L, column C: `` or "", the problem, the hint) of a YAML error."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return where, shown(str(problem), quote=False), getattr(exc, "hint", _SYNTAX_HINT)


def _read_bounded(path: Path, what: str) -> str:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_YAML_BYTES + 1)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problem = f"cannot be read: {shown(str(exc), quote=False)}"
        problem = "not found" if isinstance(exc, FileNotFoundError) else problem
        where = f"{what} file {shown(str(path))}"
        raise ConfigError(f"{where} {problem}", hint="check the path") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(
            f"{path}: the {what} file is larger than {MAX_YAML_BYTES // 2**20} MiB",
            hint=_SIZE_HINT,
        )
    return text


def read_yaml_mapping(path: Path, what: str) -> dict[str, object]:
    """The top-level mapping of a YAML file, or a ConfigError naming the file (and line)."""
    try:
        data = _load(_read_bounded(path, what))
    except yaml.YAMLError as exc:
        where, problem, hint = _problem(exc)
        raise ConfigError(f"{path}: {where}invalid YAML: {problem}", hint=hint) from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty", hint=f"a {what} is a mapping of fields")
    if isinstance(data, dict):
        for key in data:
            if not isinstance(key, str):
                raise ConfigError(
                    f"{path}: key {shown(key)} is not a field name", hint="e.g. nodes: 2"
                )
        return data
    raise ConfigError(
        f"{path}: the {what} is a {type(data).__name__}, not a mapping of field names",
        hint="write one 'field: value' per line, e.g. nodes: 2",
    )


def parse_yaml_value(text: str, label: str, hint: str) -> object:
    """One value written in YAML (a ``--set`` value), or a ConfigError ``<label>: ...``."""
    try:
        return _load(text)
    except yaml.YAMLError as exc:
        where, problem, own_hint = _problem(exc)
        where = where if "\n" in text.strip() else ""  # a one-line value: the column says little
        return_hint = own_hint if own_hint != _SYNTAX_HINT else hint
        raise ConfigError(
            f"{label}: the value is not valid YAML ({where}{problem})", hint=return_hint
        ) from None
