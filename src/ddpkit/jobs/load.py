"""Reading job specs and cluster profiles from YAML, and the one place their layers merge.

Precedence, for every field (stated here only; ``merge_layers`` is its one implementation)::

    --set key=value   >   the spec file   >   the spec's cluster profile   >   built-in defaults

- ``env``, ``sbatch`` and ``sweep`` merge key by key with the same precedence (``sweep``'s
  keys are ``params``, ``mode``, ``max_parallel``: ``--sweep NAME=V1,V2`` options, together
  the ``--sweep`` layer just below ``--set``, replace the spec's whole ``params``);
- ``setup`` lines accumulate: the profile's lines, then the spec's, then those given by --set;
- null (``partition: null``, ``--set partition=``, ``--set env.FOO=``) resets a field or a
  mapping key to its built-in default, dropping whatever a lower layer said; for ``signal``,
  whose default is USR2, null means none (no stop signal), as the field says.

``--set`` takes ``key=value``; ``env.NAME=value`` and ``sbatch.option=value`` reach into the two
mappings. A value that YAML reads as a number, true/false or null, or a flow ``[...]``/``{...}``
or quoted scalar, is taken as YAML (``nodes=2`` is an integer); anything else is the literal text
(so ``env.TOKEN=#x`` keeps its ``#``).

Relative paths: ``workdir`` and ``template`` are relative to the directory of the file that wrote
them, or to the current directory for ``--set`` (the default ``workdir``); ``log_dir`` stays
relative to ``workdir`` (SLURM resolves it there). Profiles are found by
:mod:`ddpkit.jobs.profiles`.

Every problem is one ``ConfigError`` line, ``<source>: <field.path>=<value!r>: <problem>
(hint: ...)``, naming the file (or ``--set``) that supplied the bad value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from ddpkit.errors import ConfigError
from ddpkit.jobs.profiles import find_profile, profile_search_path
from ddpkit.jobs.spec import ClusterProfile, JobSpec
from ddpkit.jobs.spec_checks import shown
from ddpkit.jobs.spec_errors import config_error, field_path
from ddpkit.jobs.spec_yaml import parse_yaml_value, read_yaml_mapping
from ddpkit.masking import MASKED, mask_text, secret_name

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
    "resolve_spec",
]

SET_SOURCE = "--set"
SWEEP_SOURCE = "--sweep"
MAPPING_FIELDS = ("env", "sbatch", "sweep", "container")
ACCUMULATING_FIELDS = ("setup",)
# Fields whose null means "none" rather than "the default" (the default is not none):
# ``signal: null`` is a job without a stop signal, as the field's doc says.
NULL_IS_NONE = ("signal",)
PATH_FIELDS = ("workdir", "template")

Layer = tuple[str, Mapping[str, object]]  # (source label, field -> value)
_M = TypeVar("_M", bound=BaseModel)


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
                f"--set {shown(mask_text(item))} is not KEY=VALUE",
                hint="e.g. --set nodes=2 or --set env.X=1",
            )
        value = _parse_value(item, text)
        top, dot, sub = key.partition(".")
        if not dot:
            layer[top] = value
            continue
        if top in JobSpec.model_fields and top not in MAPPING_FIELDS:
            raise ConfigError(
                f"--set {shown(mask_text(item))}: {shown(top, quote=False)} is not a mapping",
                hint="only env, sbatch and container take dotted keys, e.g. --set env.X=1",
            )
        if top == "sweep" and "." in sub:  # one level only: sweep.params is set whole
            raise ConfigError(
                f"--set {shown(item)}: {shown(key.rpartition('.')[0], quote=False)} is not "
                "set key by key",
                hint="give a sweep parameter with --sweep NAME=V1,V2, or the whole mapping: "
                "--set 'sweep.params={lr: [0.1, 0.01]}'",
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
                f"--sweep {shown(item)} is not NAME=VALUE,VALUE,...",
                hint="e.g. --sweep lr=0.1,0.01 (values with commas: a sweep: section in YAML)",
            )
        if name in params:
            raise ConfigError(
                f"--sweep {shown(item)}: parameter {shown(name)} is given twice",
                hint="list all its values in one option, e.g. "
                f"--sweep {shown(name, quote=False)}=1,2,3",
            )
        params[name] = text.split(",") if text else []
    return {"sweep": {"params": params}} if params else {}


def _set_shown(item: str) -> str:
    """``--set KEY=VALUE`` as an error quotes it: the value hidden when the key's last part
    looks secret (``env.HF_TOKEN=***``), else with the credentials inside it hidden."""
    key = item.partition("=")[0]
    if secret_name(key.rpartition(".")[2]):
        return shown(f"{key}={MASKED}")
    return shown(mask_text(item))


def _parse_value(item: str, text: str) -> object:
    if text == "":
        return None
    resolver = yaml.resolver.Resolver()
    tag = resolver.resolve(yaml.ScalarNode, text, (True, False))  # type: ignore[no-untyped-call]
    if tag == "tag:yaml.org,2002:str" and text[:1] not in "[{'\"":
        return text  # plain text: no YAML comment stripping or ': ' surprises
    return parse_yaml_value(
        text,
        f"--set {_set_shown(item)}",
        "quote the whole argument for the shell, e.g. --set 'command=[a.py, \"x y\"]'",
    )


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
            if value is None and key in NULL_IS_NONE:
                merged[key] = None
            elif value is None:
                merged.pop(key, None)
            elif key in MAPPING_FIELDS and isinstance(value, Mapping):
                below = merged.get(key)
                entries = dict(below) if isinstance(below, Mapping) else {}
                for sub, sub_value in value.items():
                    origins[field_path(key, sub)] = source
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
    return build_spec(
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
    """Read a YAML job spec with ``--set key=value`` and ``--sweep name=v1,v2`` overrides:
    :func:`resolve_spec`'s spec."""
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
) -> ResolvedSpec:
    """:func:`resolve_spec` for fields already in memory; relative paths resolve against
    ``base_dir`` (default ``cwd``). ``source`` names the spec in error messages."""
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
        raise config_error(exc, model, data, origins, source) from None
