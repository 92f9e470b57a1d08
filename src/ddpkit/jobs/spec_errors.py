"""A pydantic ``ValidationError`` of a spec or profile as the one ``ConfigError`` line.

``<source>: <field.path>=<value>: <problem> (hint: ...)`` for the first error (an unknown key
first), naming the file (or ``--set``) that supplied the value, quoted short and masked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast, get_args

from pydantic import BaseModel, ValidationError

from ddpkit.errors import ConfigError
from ddpkit.hints import closest, did_you_mean
from ddpkit.jobs.spec import ClusterProfile, JobSpec
from ddpkit.jobs.spec_checks import ERROR_TYPE, LIMIT_HINTS, shown
from ddpkit.masking import MASKED, mask_text, secret_name

__all__ = ["config_error", "field_path"]

_KEY_CHARS = 80


def field_path(parent: str, key: object) -> str:
    """``env.FOO``; a key that would not read back on one line as written (``"FOO\\n"``, a
    space) is shown as its repr, ``env['FOO\\n']``, so the one-line error stays one line, and
    a long one cut short (``env['FOOO...'...]``)."""
    text = str(key)
    if text and text.isprintable() and " " not in text and len(text) <= _KEY_CHARS:
        return f"{parent}.{text}"
    return f"{parent}[{shown(text, _KEY_CHARS)}]"


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
    "less_than_equal": "is more than {le}, ddpkit's limit",
}


def config_error(
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
        inner = model  # inside a section (sweep:): its whole path, and that section's keys
        for part in error["loc"][:-1]:
            inner = _section_model(inner, str(part)) or inner
        if inner is model:
            return ConfigError(
                f"{where}: unknown key {shown(top)}", hint=_unknown_key_hint(top, model)
            )
        hint = _unknown_key_hint(str(error["loc"][-1]), inner)
        return ConfigError(f"{where}: unknown key {shown(path)}", hint=hint)
    custom = error["type"] == ERROR_TYPE
    problem = ctx["problem"] if custom else _problem(error["type"], error["msg"], ctx)
    hint = ctx["hint"] if custom else _field_hint(model, top, error["type"], value)
    label = path if is_key or error["type"] == "missing" else f"{path}={_value(path, value)}"
    return ConfigError(f"{where}: {label}: {problem}", hint=hint)


def _value(path: str, value: object) -> str:
    """``value`` as the error quotes it, by :mod:`ddpkit.masking`'s rule: hidden whole when the
    field's own name looks secret (``env.HF_TOKEN``), else with the credentials inside hidden."""
    if secret_name(path.rpartition(".")[2]):
        return MASKED
    return mask_text(shown(value))


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
            path, current = (field_path(path, item) if path else str(item)), current[item]
        elif isinstance(current, list) and isinstance(item, int) and 0 <= item < len(current):
            path, current = f"{path}[{item}]", current[item]
        else:
            if not path:  # a field absent from the input (missing)
                path, current = str(item), None
            elif isinstance(current, Mapping) and item == loc[-1]:  # absent from a section
                path, current = field_path(path, item), None
            break
    return path, current, is_key


def _problem(kind: str, msg: str, ctx: Mapping[str, Any]) -> str:
    if kind in _PROBLEMS:
        return _PROBLEMS[kind].format(**ctx)
    return msg[:1].lower() + msg[1:]


def _field_hint(model: type[BaseModel], field: str, kind: str, value: object) -> str:
    info = model.model_fields.get(field)
    hint = (info.description if info else None) or "see the JobSpec fields"
    if kind == "less_than_equal":
        return LIMIT_HINTS.get(field, hint)
    if kind == "literal_error" and isinstance(value, str) and info is not None:
        choices = [str(choice) for choice in getattr(info.annotation, "__args__", ())]
        if closest(value, choices) is not None:
            return did_you_mean(value, choices, hint=hint)
    quotable = isinstance(value, bool | int | float)
    if kind == "string_type" and quotable and "quote" not in hint:
        hint += "; YAML reads yes/no/on/off/true/false and numbers as non-strings: quote them"
    return hint


def _section_model(model: type[BaseModel], field: str) -> type[BaseModel] | None:
    """The model of ``model``'s field ``field`` when it is a section of its own (``sweep``)."""
    info = model.model_fields.get(field)
    kinds = () if info is None else (info.annotation, *get_args(info.annotation))
    return next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)


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
