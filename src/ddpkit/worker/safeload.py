"""Which checkpoint a load restores, and reading it without running code from it.

:func:`read_checkpoint` takes a folder (the newest checkpoint that loads, others skipped with a
warning; None when there is none or the folder does not exist yet) or one checkpoint file
(exactly that one, or an error). A missing path named like a file (``*.pt``) is an error, not a
fresh start.

Unpickling runs whatever a file names, so a checkpoint is read with
``torch.load(weights_only=True)``, whose restricted unpickler builds only plain data (tensors,
numbers, strings, containers) and refuses any other global. Allowed besides, for one load only
(torch's list is restored afterwards): what ddpkit itself stores, numpy's RNG state and the
``trusted_types`` the caller passes knowingly. A file that names anything else is refused with
:class:`~ddpkit.errors.CheckpointError` naming every such global and how to trust it. This load
is the only reader of a checkpoint's pickle (:mod:`ddpkit.worker.ckptfiles` reads names only).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.serialization

from ddpkit import compat
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.worker import ckptfiles
from ddpkit.worker.durable import open_regular

__all__ = ["READABLE", "check_trusted", "load_file", "read_checkpoint"]

READABLE = (1, 2, 3, 4)  # payload formats a load takes (3: order in the name, 4: + sharded)
_Read = tuple[Path, dict[str, Any]]  # a checkpoint's file and its payload


def read_checkpoint(path: Path, map_location: Any, trusted: list[Any]) -> _Read | None:
    """The checkpoint to restore and its file: the file ``path`` (one that does not load is an
    error: asked for by name, it is not swapped for another one), or the newest loadable one
    in the folder ``path``, every file skipped on the way warned of; None for an empty or
    missing folder. A file that holds a type the load refuses is never skipped: it raises."""
    if path.is_file():
        payload, why = _load(path, map_location, trusted)
        if payload is None:
            raise CheckpointError(
                f"checkpoint file {path} {why}",
                hint=f"pass a file that save_checkpoint wrote, or its folder {path.parent} to "
                "resume from the newest checkpoint there that loads",
            )
        return path, payload
    if path.is_dir():
        for entry in reversed(ckptfiles.written(path)):
            payload, why = _load(entry.path, map_location, trusted)
            if payload is not None:
                return entry.path, payload
            warnings.warn(
                f"skipping checkpoint {entry.path}: it {why}; the newest loadable one is used "
                "instead",
                RuntimeWarning,
                stacklevel=4,  # load_checkpoint's caller
            )
        return None
    if path.exists():
        raise CheckpointError(
            f"{path} is neither a checkpoint folder nor a checkpoint file",
            hint="pass the folder given to save_checkpoint, or one checkpoint file in it",
        )
    if ckptfiles.COMPLETE.fullmatch(path.name) or path.suffix in {".pt", ".pth"}:
        raise CheckpointError(
            f"checkpoint file {path} does not exist",
            hint=f"pass its folder {path.parent} to resume from the newest checkpoint there "
            "(keep_last may have pruned this one)",
        )
    return None  # a fresh run: save_checkpoint creates the folder


def _load(path: Path, map_location: Any, trusted: list[Any]) -> tuple[dict[str, Any] | None, str]:
    """The payload in ``path``, or None and why not."""
    try:
        payload = load_file(path, map_location, trusted)
    except CheckpointError:
        raise
    except Exception as error:  # damaged (truncated, not a zip, a bad pickle)
        return None, f"cannot be loaded ({brief(error)})"
    if not _valid(payload):
        return None, "was not written by ddpkit.save_checkpoint"
    return dict(payload), ""


def _valid(payload: object) -> bool:
    """Whether ``payload`` has the shape of a ddpkit checkpoint."""
    return (
        isinstance(payload, dict)
        and payload.get("format") in READABLE
        and isinstance(payload.get("step"), int)
        and isinstance(payload.get("state"), dict)
        and isinstance(payload.get("rng"), list)
    )


def brief(error: BaseException) -> str:
    """``error`` in one line: its type and the first line of its own words (torch's
    weights-only refusals wrap one line in a page of advice; a damaged zip says it in one)."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1]
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if len(line) > _BRIEF_CHARS:
        line = line[: _BRIEF_CHARS - 3] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


_BRIEF_CHARS = 300  # a file's own words can be long: a bound for a one-line error


def load_file(path: Path, map_location: Any, trusted: Sequence[Any]) -> Any:
    """``torch.load(path, weights_only=True)`` with ddpkit's and the ``trusted`` globals
    allowed; :class:`CheckpointError` when the file names a global that is not."""
    with _allowed([*_ddpkit_globals(), *trusted]), open_regular(path) as file:
        try:
            return torch.load(file, map_location=map_location, weights_only=True)
        except Exception as error:
            names = compat.refused_globals(error, file)
            if not names:
                raise  # damaged, not refused
    listed = ", ".join(names)
    raise CheckpointError(
        f"checkpoint {path} holds {listed}, which load_checkpoint does not unpickle: "
        "unpickling anything but tensors, numbers, strings and containers can run code",
        hint=f"if you trust this file (your own run wrote it), pass "
        f"load_checkpoint(..., trusted_types=[{listed}]); if you did not write it, remove it",
    )


def check_trusted(trusted: object) -> list[Any]:
    """``trusted_types`` as a list: classes or functions, or ``(obj, "module.name")`` pairs
    (torch's form for a global saved under another name); ConfigError for anything else."""
    if isinstance(trusted, str | bytes) or not isinstance(trusted, Sequence | set | frozenset):
        raise ConfigError(
            f"trusted_types={trusted!r} must be a list of classes or functions",
            hint="e.g. trusted_types=[MyConfig], the types your own state holds",
        )
    items = list(trusted)
    for item in items:
        pair = isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], str)
        if not (callable(item[0]) if pair else callable(item)):
            raise ConfigError(
                f"trusted_types holds {item!r}, which is neither a class nor a function",
                hint="pass the class itself (trusted_types=[MyConfig]), not an instance "
                "or its name",
            )
    return items


def _ddpkit_globals() -> list[Any]:
    """The globals of what ddpkit stores beyond torch's defaults: numpy's RNG state."""
    try:
        import numpy
    except ImportError:  # numpy is optional: no numpy state was saved then
        return []
    array = numpy.zeros(1, dtype=numpy.uint32)
    rebuild = array.__reduce__()[0]  # numpy's _reconstruct, wherever this numpy keeps it
    found: list[Any] = [rebuild, numpy.ndarray, numpy.dtype, type(array.dtype)]
    if _TUPLES_ALLOWED:  # a file written under numpy 1 names it numpy.core, under 2 numpy._core
        found += [(rebuild, f"numpy.{core}.multiarray._reconstruct") for core in ("core", "_core")]
    return found


# torch 2.6 accepts (global, "module.name") pairs; earlier versions only the globals themselves
_TUPLES_ALLOWED = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 6)


@contextmanager
def _allowed(extra: list[Any]) -> Iterator[None]:
    """``extra`` allowed for ``weights_only`` loads while the block runs. Afterwards only what
    it added is taken away again: an entry the user (or torch, importing a module meanwhile)
    added stays; torch's own ``safe_globals`` context would remove the user's too."""
    before = torch.serialization.get_safe_globals()
    added = [item for item in extra if item not in before]
    torch.serialization.add_safe_globals(added)
    try:
        yield
    finally:
        after = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals([item for item in after if item not in added])
