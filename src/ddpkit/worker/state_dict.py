"""One state-dict format across ``single``, ``dp``, ``ddp`` and compiled models.

DDP and DataParallel put ``module.`` before every key, ``torch.compile`` puts ``_orig_mod.``
(before every key, or inside those of a compiled submodule), in any nesting. Cleaning drops
every ``_orig_mod`` segment and leading ``module`` segments while *every* key has one: a model
whose only child is named ``module`` loses its prefix as well, which is why
:func:`load_state_dict` cleans both sides and matches them, exact in every direction. The state
dict's ``_metadata`` is renamed the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from ddpkit import compat
from ddpkit.errors import ConfigError

__all__ = ["clean_state_dict", "load_state_dict", "unwrap"]

_WRAPPER = "module"


def unwrap(model: nn.Module) -> nn.Module:
    """``model`` without its DDP, DataParallel and torch.compile wrappers (any nesting)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
            continue
        inner = compat.compiled_inner(model)
        if inner is None:
            return model
        model = inner


def clean_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """``state_dict`` with the ``module.`` and ``_orig_mod.`` prefixes removed (a new dict)."""
    names = _clean_names(state_dict)
    cleaned: OrderedDict[str, Any] = OrderedDict(
        (names[key], value) for key, value in state_dict.items()
    )
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        depth = _depth(state_dict)
        cleaned._metadata = OrderedDict(  # type: ignore[attr-defined]
            (_clean_prefix(prefix, depth), value) for prefix, value in metadata.items()
        )
    return cleaned


def load_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> Any:
    """``model.load_state_dict`` for a state dict from any mode (returns torch's result).

    The keys of both sides are cleaned and matched, then renamed to what ``model`` (unwrapped)
    expects; keys that match nothing keep their cleaned name, so ``strict`` reports them.
    """
    target = unwrap(model)
    own = target.state_dict()
    wanted = {cleaned: key for key, cleaned in _clean_names(own).items()}
    given = clean_state_dict(state_dict)
    renamed: OrderedDict[str, Any] = OrderedDict(
        (wanted.get(key, key), value) for key, value in given.items()
    )
    metadata = getattr(given, "_metadata", None)
    own_metadata = getattr(own, "_metadata", None)
    if metadata is not None and own_metadata is not None:
        depth = _depth(own)
        prefixes = {_clean_prefix(prefix, depth): prefix for prefix in own_metadata}
        renamed._metadata = OrderedDict(  # type: ignore[attr-defined]
            (prefixes.get(prefix, prefix), value) for prefix, value in metadata.items()
        )
    return target.load_state_dict(renamed, strict=strict)


def _clean_names(keys: Iterable[str]) -> dict[str, str]:
    """Each key's cleaned name; two keys cleaning to one name is an error."""
    keys = list(keys)
    depth = _depth(keys)
    names = {key: _clean_prefix(key, depth) for key in keys}
    if len(set(names.values())) < len(names):
        seen: dict[str, str] = {}
        for key, name in names.items():
            if name in seen:
                raise ConfigError(
                    f"state dict keys {seen[name]!r} and {key!r} both become {name!r} without "
                    "the module./_orig_mod. prefixes",
                    hint="load it with the model's own load_state_dict: the prefixes are needed",
                )
            seen[name] = key
    return names


def _segments(key: str) -> list[str]:
    return [part for part in key.split(".") if part != compat.COMPILED_ATTRIBUTE] if key else []


def _depth(keys: Iterable[str]) -> int:
    """How many leading ``module`` segments every key has (after dropping ``_orig_mod``),
    always leaving at least one segment."""
    every = [_segments(key) for key in keys]
    depth = 0
    while every and all(len(parts) > depth + 1 and parts[depth] == _WRAPPER for parts in every):
        depth += 1
    return depth


def _clean_prefix(key: str, depth: int) -> str:
    parts = _segments(key)
    for _ in range(depth):
        if parts and parts[0] == _WRAPPER:
            parts = parts[1:]
    return ".".join(parts)
