"""Reading job specs and cluster profiles from YAML, and the one place their layers merge.

Precedence, for every field (stated here only; ``merge_layers`` is its one implementation)::

    --set key=value   >   the spec file   >   the spec's cluster profile   >   built-in defaults

- ``env``, ``sbatch`` and ``sweep`` merge key by key with the same precedence (``sweep``'s
  keys are ``params``, ``mode``, ``max_parallel``: ``--sweep NAME=V1,V2`` options, together
  the ``--sweep`` layer just below ``--set``, replace the spec's whole ``params``);
- ``setup`` lines accumulate: the profile's lines, then the spec's, then those given by --set;
- null (``partition: null``, ``--set partition=``, ``--set env.FOO=``) resets a field or a
  mapping key to its built-in default, dropping whatever a lower layer said.

``--set`` takes ``key=value``; ``env.NAME=value`` and ``sbatch.option=value`` reach into the two
mappings. A value that YAML reads as a number, true/false or null, or a flow ``[...]``/``{...}``
or quoted scalar, is taken as YAML (``nodes=2`` is an integer); anything else is the literal text
(so ``env.TOKEN=#x`` keeps its ``#``).

Relative paths: ``workdir`` and ``template`` are relative to the directory of the file that wrote
them (the spec's or the profile's), or to the current directory for ``--set``; the result is
absolute. ``log_dir`` stays relative to ``workdir`` (SLURM resolves it there), and ``command``
and ``python`` run as written, from ``workdir``. Without a ``workdir``, it is the current
directory.

Profiles: ``profile:`` is a path or a name; where a name is looked up, and why a name found in
two places is an error, is :mod:`ddpkit.jobs.profiles`. The resolved spec keeps the profile's
name for the record; its values are already merged in, and :func:`resolve_spec` also says which
file they came from.

Every problem is a ``ConfigError`` with one line,
``<source>: <field.path>=<value!r>: <problem> (hint: ...)``, where ``<source>`` is the file (or
``--set``) that supplied the bad value. Nothing is returned unless the whole spec is valid.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from pydantic import BaseModel, ValidationError

from ddpkit.errors import ConfigError
from ddpkit.hints import closest, did_you_mean
from ddpkit.jobs.checks import shown
from ddpkit.jobs.profiles import find_profile, profile_search_path
from ddpkit.jobs.spec import ERROR_TYPE, ClusterProfile, JobSpec

__all__ = [
    "SET_SOURCE",
    "ResolvedSpec",
    "build_spec",
    "load_profile",
    "load_spec",
    "merge_layers",
    "parse_overrides",
    "parse_sweeps",
    "profile_search_path",
    "read_profile",
    "read_yaml_mapping",
    "resolve_spec",
]

SET_SOURCE = "--set"
SWEEP_SOURCE = "--sweep"
MAPPING_FIELDS = ("env", "sbatch", "sweep")
ACCUMULATING_FIELDS = ("setup",)
PATH_FIELDS = ("workdir", "template")

Layer = tuple[str, Mapping[str, object]]  # (source label, field -> value)
_M = TypeVar("_M", bound=BaseModel)


class _DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping gives the same key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice (plain YAML keeps the last one)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[object] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if isinstance(key, str | int | float | bool) and key in seen:
            raise _DuplicateKeyError(None, None, f"key {key!r} appears twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml_mapping(path: Path, what: str) -> dict[str, object]:
    """The top-level mapping of a YAML file, or a ConfigError naming the file (and line)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} file {str(path)!r} not found", hint="check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{what} file {str(path)!r} cannot be read: {exc}", hint="check the path"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        hint = "check indentation and quoting there; quote values containing ': ' or ' #'"
        if isinstance(exc, _DuplicateKeyError):
            hint = "give each key once; the later one would silently win"
        raise ConfigError(f"{path}: {where}invalid YAML: {problem}", hint=hint) from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty", hint=f"a {what} is a mapping of fields")
    if isinstance(data, dict):
        for key in data:
            if not isinstance(key, str):
                raise ConfigError(f"{path}: key {key!r} is not a field name", hint="e.g. nodes: 2")
        return data
    raise ConfigError(
        f"{path}: the {what} is a {type(data).__name__}, not a mapping of field names",
        hint="write one 'field: value' per line, e.g. nodes: 2",
    )


def _resolve_paths(layer: Mapping[str, object], base: Path) -> dict[str, object]:
    """``layer`` with its relative ``workdir``/``template`` made absolute against ``base``."""
    out = dict(layer)
    for key in PATH_FIELDS:
        value = out.get(key)
        if isinstance(value, str) and value.strip():
            out[key] = os.path.normpath(base / os.path.expanduser(value))
    return out


def parse_overrides(overrides: Sequence[str]) -> dict[str, object]:
    """``["nodes=2", "env.NCCL_DEBUG=INFO"]`` -> ``{"nodes": 2, "env": {"NCCL_DEBUG": "INFO"}}``."""
    layer: dict[str, object] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"--set {item!r} is not KEY=VALUE", hint="e.g. --set nodes=2 or --set env.X=1"
            )
        value = _parse_value(item, text)
        top, dot, sub = key.partition(".")
        if not dot:
            layer[top] = value
            continue
        if top in JobSpec.model_fields and top not in MAPPING_FIELDS:
            raise ConfigError(
                f"--set {item!r}: {top} is not a mapping",
                hint="only env and sbatch take dotted keys, e.g. --set env.NCCL_DEBUG=INFO",
            )
        current = layer.get(top)
        layer[top] = {**(current if isinstance(current, dict) else {}), sub: value}
    return layer


def parse_sweeps(items: Sequence[str]) -> dict[str, object]:
    """``["lr=0.1,0.01", "seed=1,2"]`` -> the layer ``{"sweep": {"params": {...}}}`` (empty
    for no items). Values are split at commas and kept as text; the spec checks them."""
    params: dict[str, list[str]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(
                f"--sweep {item!r} is not NAME=VALUE,VALUE,...",
                hint="e.g. --sweep lr=0.1,0.01 (values with commas: a sweep: section in YAML)",
            )
        if name in params:
            raise ConfigError(
                f"--sweep {item!r}: parameter {name!r} is given twice",
                hint=f"list all its values in one option, e.g. --sweep {name}=1,2,3",
            )
        params[name] = text.split(",") if text else []
    return {"sweep": {"params": params}} if params else {}


def _parse_value(item: str, text: str) -> object:
    if text == "":
        return None
    resolver = yaml.resolver.Resolver()
    tag = resolver.resolve(yaml.ScalarNode, text, (True, False))  # type: ignore[no-untyped-call]
    if tag == "tag:yaml.org,2002:str" and text[:1] not in "[{'\"":
        return text  # plain text: no YAML comment stripping or ': ' surprises
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--set {item!r}: the value is not valid YAML ({getattr(exc, 'problem', exc)})",
            hint="quote the whole argument for the shell, e.g. --set 'command=[a.py, \"x y\"]'",
        ) from None


def _field_path(parent: str, key: object) -> str:
    """``env.FOO``; a key that would not read back on one line as written (``"FOO\\n"``, a
    space) is shown as its repr, ``env['FOO\\n']``, so the one-line error stays one line."""
    text = str(key)
    if text and text.isprintable() and " " not in text:
        return f"{parent}.{text}"
    return f"{parent}[{text!r}]"


def merge_layers(layers: Sequence[Layer]) -> tuple[dict[str, object], dict[str, str]]:
    """Merge ``(source, fields)`` layers, lowest precedence first, by the module's rules.

    Returns the merged fields and, for each field path (``nodes``, ``env.X``, ``setup[2]``), the
    source that supplied it, so an error can name the file it came from.
    """
    merged: dict[str, object] = {}
    origins: dict[str, str] = {}
    for source, layer in layers:
        for key, value in layer.items():
            origins[key] = source
            if value is None:
                merged.pop(key, None)
            elif key in MAPPING_FIELDS and isinstance(value, Mapping):
                below = merged.get(key)
                entries = dict(below) if isinstance(below, Mapping) else {}
                for sub, sub_value in value.items():
                    origins[_field_path(key, sub)] = source
                    if sub_value is None:
                        entries.pop(sub, None)
                    else:
                        entries[sub] = sub_value
                merged[key] = entries
            elif key in ACCUMULATING_FIELDS:
                below = merged.get(key)
                lines = list(below) if isinstance(below, list) else []
                added = value if isinstance(value, list) else [value]
                origins.update({f"{key}[{len(lines) + i}]": source for i in range(len(added))})
                merged[key] = [*lines, *added]
            else:
                merged[key] = value
    return merged, origins


def load_profile(
    name_or_path: str,
    *,
    search: Sequence[Path],
    base_dir: Path | None = None,
    origin: str = "profile",
) -> ClusterProfile:
    """Find a profile by path (relative to ``base_dir``, default cwd) or name, and validate it.

    ``origin`` labels "not found" errors (e.g. the spec file that named the profile). A file
    without ``name:`` gets its file name. Its relative ``template`` becomes absolute.
    """
    path = find_profile(name_or_path, search, base_dir or Path.cwd(), origin)
    return read_profile(path)


def read_profile(path: Path) -> ClusterProfile:
    """Validate the profile file at ``path`` (no lookup)."""
    data = _resolve_paths(read_yaml_mapping(path, "profile"), path.parent)
    data.setdefault("name", path.stem)
    return _validate(ClusterProfile, data, {}, str(path))


@dataclass(frozen=True)
class ResolvedSpec:
    """A validated spec, and the profile file merged into it (None: the spec has no profile)."""

    spec: JobSpec
    profile_path: Path | None


def resolve_spec(
    path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    sweeps: Sequence[str] = (),
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> ResolvedSpec:
    """Read, merge (profile, spec, ``--sweep`` and ``--set`` overrides) and validate the job
    spec at ``path``; say which profile file was used.

    ``cwd`` (default: the current directory) anchors ``--set`` paths, the default workdir and the
    ``./profiles`` lookup; ``env`` (default ``os.environ``, only read) gives DDPKIT_HOME.
    """
    data, base_dir = read_yaml_mapping(Path(path), "spec"), Path(path).absolute().parent
    source = str(path)
    return _build(
        data, overrides, sweeps=sweeps, source=source, base_dir=base_dir, cwd=cwd, env=env
    )


def load_spec(
    path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    sweeps: Sequence[str] = (),
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> JobSpec:
    """:func:`resolve_spec`'s spec."""
    return resolve_spec(path, overrides, sweeps=sweeps, cwd=cwd, env=env).spec


def build_spec(
    data: Mapping[str, object],
    overrides: Sequence[str] = (),
    *,
    sweeps: Sequence[str] = (),
    source: str = "<spec>",
    base_dir: Path | None = None,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> JobSpec:
    """``load_spec`` for fields already in memory; relative paths resolve against ``base_dir``
    (default ``cwd``). ``source`` names the spec in error messages."""
    return _build(
        data, overrides, sweeps=sweeps, source=source, base_dir=base_dir, cwd=cwd, env=env
    ).spec


def _build(
    data: Mapping[str, object],
    overrides: Sequence[str],
    *,
    sweeps: Sequence[str],
    source: str,
    base_dir: Path | None,
    cwd: Path | None,
    env: Mapping[str, str] | None,
) -> ResolvedSpec:
    cwd = (cwd or Path.cwd()).absolute()
    base_dir = (base_dir or cwd).absolute()
    spec_layer = _resolve_paths(data, base_dir)
    set_layer = _resolve_paths(parse_overrides(overrides), cwd)
    layers: list[Layer] = []
    ref, ref_source, ref_base = spec_layer.get("profile"), source, base_dir
    if "profile" in set_layer:
        ref, ref_source, ref_base = set_layer["profile"], SET_SOURCE, cwd
    profile_path = None
    if isinstance(ref, str) and ref.strip():
        search = profile_search_path(base_dir, cwd, os.environ if env is None else env)
        profile_path = find_profile(ref, search, ref_base, ref_source)
        layers.append((str(profile_path), read_profile(profile_path).defaults()))
    sweep_layer = parse_sweeps(sweeps)
    if sweep_layer:  # the command line's grid replaces the spec's, rather than mixing into it
        spec_sweep = spec_layer.get("sweep")
        if isinstance(spec_sweep, Mapping):
            spec_layer["sweep"] = {k: v for k, v in spec_sweep.items() if k != "params"}
    layers += [(source, spec_layer), (SWEEP_SOURCE, sweep_layer), (SET_SOURCE, set_layer)]
    merged, origins = merge_layers(layers)
    merged.setdefault("workdir", str(cwd))
    template = merged.get("template")  # read on this machine by the renderer: check it now
    if isinstance(template, str) and template.strip() and not os.path.isfile(template):
        raise ConfigError(
            f"{origins.get('template', source)}: template={shown(template)}: no such file",
            hint="a relative template path is relative to the file that names it",
        )
    return ResolvedSpec(_validate(JobSpec, merged, origins, source), profile_path)


def _validate(
    model: type[_M], data: dict[str, object], origins: Mapping[str, str], source: str
) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _config_error(exc, model, data, origins, source) from None


# -- pydantic error -> one ConfigError line ---------------------------------------------------

_PROBLEMS = {
    "int_type": "is not a whole number",
    "float_type": "is not a number",
    "string_type": "is not a string",
    "list_type": "is not a list",
    "dict_type": "is not a mapping",
    "bool_type": "is not true or false",
    "missing": "is missing",
    "literal_error": "is not one of {expected}",
    "greater_than_equal": "is less than {ge}",
    "greater_than": "is not greater than {gt}",
}


def _config_error(
    exc: ValidationError,
    model: type[BaseModel],
    data: Mapping[str, object],
    origins: Mapping[str, str],
    source: str,
) -> ConfigError:
    errors = exc.errors(include_url=False)
    # an unknown key is usually the cause of the other errors (a typo'd required field)
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    path, value, is_key = _locate(data, error["loc"])
    if "field" in ctx:
        path, value, is_key = ctx["field"], ctx.get("value"), False
    top = path.split(".")[0].split("[")[0]
    where = _origin(origins, path) or source
    if error["type"] == "extra_forbidden":
        return ConfigError(f"{where}: unknown key {top!r}", hint=_unknown_key_hint(top, model))
    custom = error["type"] == ERROR_TYPE
    problem = ctx["problem"] if custom else _problem(error["type"], error["msg"], ctx)
    hint = ctx["hint"] if custom else _field_hint(model, top, error["type"], value)
    shown = path if is_key or error["type"] == "missing" else f"{path}={value!r}"
    return ConfigError(f"{where}: {shown}: {problem}", hint=hint)


def _origin(origins: Mapping[str, str], path: str) -> str | None:
    """The source of the longest known prefix of ``path`` (``sweep.params.lr[0]`` ->
    ``sweep.params`` -> ``sweep``)."""
    while path:
        if path in origins:
            return origins[path]
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""
    return None


def _locate(data: Mapping[str, object], loc: tuple[int | str, ...]) -> tuple[str, object, bool]:
    """(``env.X``/``setup[2]`` path, value, is-a-key-error) of an error location in the input.

    The walk stops at the first item not in the data (pydantic adds ``[key]``, union members).
    """
    path, current, is_key = "", cast(object, data), False
    for item in loc:
        if item == "[key]":
            is_key = True
            break
        if isinstance(current, Mapping) and item in current:
            path, current = (_field_path(path, item) if path else str(item)), current[item]
        elif isinstance(current, list) and isinstance(item, int) and 0 <= item < len(current):
            path, current = f"{path}[{item}]", current[item]
        else:
            if not path:  # a field absent from the input (missing)
                path, current = str(item), None
            break
    return path, current, is_key


def _problem(kind: str, msg: str, ctx: Mapping[str, Any]) -> str:
    if kind in _PROBLEMS:
        return _PROBLEMS[kind].format(**ctx)
    return msg[:1].lower() + msg[1:]


def _field_hint(model: type[BaseModel], field: str, kind: str, value: object) -> str:
    info = model.model_fields.get(field)
    hint = (info.description if info else None) or "see the JobSpec fields"
    if kind == "literal_error" and isinstance(value, str) and info is not None:
        choices = [str(choice) for choice in getattr(info.annotation, "__args__", ())]
        if closest(value, choices) is not None:
            return did_you_mean(value, choices, hint=hint)
    quotable = isinstance(value, bool | int | float)
    if kind == "string_type" and quotable and "quote" not in hint:
        hint += "; YAML reads yes/no/on/off/true/false and numbers as non-strings: quote them"
    return hint


def _unknown_key_hint(key: str, model: type[BaseModel]) -> str:
    fields = list(model.model_fields)
    if model is ClusterProfile and key in JobSpec.model_fields:
        return f"{key!r} is a job setting: set it in the spec, not in a profile"
    match = closest(key, fields)
    if match is None and key:  # 'gpus' -> gpus_per_node, 'mem' -> mem_gb: names carry their unit
        match = next((f for f in fields if f.startswith(key.rstrip("_") + "_")), None)
    if match is not None:
        return f"did you mean {match!r}?"
    return f"known keys: {', '.join(fields)}"
