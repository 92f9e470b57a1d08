"""Where a spec's ``profile:`` is found: the folders searched, and the one rule between them.

A profile carries ``setup:`` shell lines that run in the job, as the user who submits it, so
which file is used must never depend on where one happens to stand. ``profile:`` is either

- a path (it has a ``/``, starts with ``~`` or ends in ``.yaml``/``.yml``): that file, relative
  to the directory of the file that wrote it (the spec's, or the current one for ``--set``); or
- a name, looked up as ``<name>.yaml`` and ``<name>.yml`` in, in this order:

  1. ``<spec dir>/profiles``: next to the spec, as trusted as the spec itself;
  2. ``./profiles``: the current directory's;
  3. the user's own: ``$DDPKIT_HOME/profiles`` when ``DDPKIT_HOME`` is set, else
     ``${XDG_CONFIG_HOME:-~/.config}/ddpkit/profiles``.

A name found as more than one file (two folders, or ``.yaml`` and ``.yml`` in one) is an error
naming every file, not a silent choice: a shared folder's ``profiles/`` must not shadow the
user's own, nor the user's own replace a project's. The same file reached twice is one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ddpkit.contract import HOME_VAR
from ddpkit.errors import ConfigError
from ddpkit.hints import closest
from ddpkit.jobs.spec_checks import shown

__all__ = ["PROFILE_EXTENSIONS", "find_profile", "profile_search_path"]

PROFILE_EXTENSIONS = (".yaml", ".yml")


def user_profile_dir(env: Mapping[str, str]) -> Path:
    """The user's own profiles: ``$DDPKIT_HOME/profiles``, else the XDG config folder's."""
    if env.get(HOME_VAR):
        return Path(env[HOME_VAR]).expanduser() / "profiles"
    user_home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    return Path(env.get("XDG_CONFIG_HOME") or user_home / ".config") / "ddpkit" / "profiles"


def profile_search_path(spec_dir: Path, cwd: Path, env: Mapping[str, str]) -> list[Path]:
    """Where a profile *name* is looked up, in order (the same folder listed once)."""
    dirs = [spec_dir / "profiles", cwd / "profiles", user_profile_dir(env)]
    return list(dict.fromkeys(Path(os.path.normpath(d)) for d in dirs))


def find_profile(ref: str, search: Sequence[Path], base_dir: Path, origin: str) -> Path:
    """The profile file ``ref`` names (see the module), or a ConfigError labelled ``origin``
    (the file or ``--set`` that named it)."""
    if "/" in ref or ref.endswith(PROFILE_EXTENSIONS) or ref.startswith("~"):  # a file's path
        path = Path(os.path.normpath(base_dir / os.path.expanduser(ref)))
        if path.is_file():
            return path
        raise ConfigError(
            f"{origin}: profile={shown(ref)}: no such file {shown(str(path))}",
            hint="profile paths are relative to the spec's directory",
        )
    found: dict[str, Path] = {}  # real path -> the first way it was reached
    for path in (d / f"{ref}{ext}" for d in search for ext in PROFILE_EXTENSIONS):
        if path.is_file():
            found.setdefault(os.path.realpath(path), path)
    if len(found) == 1:
        return next(iter(found.values()))
    if found:
        paths = list(found.values())
        raise ConfigError(
            f"{origin}: profile={shown(ref)} is defined in {len(paths)} places: "
            + ", ".join(str(p) for p in paths),
            hint=f"ddpkit does not pick one: name the file you mean, e.g. profile: {paths[-1]} "
            f"(or --set profile={paths[-1]}), or remove or rename the others",
        )
    raise _not_found(ref, search, origin)


def _not_found(ref: str, search: Sequence[Path], origin: str) -> ConfigError:
    known = sorted({p.stem for d in search if d.is_dir() for p in d.glob("*.y*ml")})
    match = closest(ref, known)
    hint = f"did you mean {match!r}?" if match else f"put {ref}.yaml in one of those folders"
    return ConfigError(
        f"{origin}: profile={shown(ref)}: not found (looked for "
        f"{', '.join(shown(str(d / (ref + '.yaml')), quote=False) for d in search)})",
        hint=f"{hint} (profiles found: {shown(', '.join(known) or 'none', quote=False)})",
    )
