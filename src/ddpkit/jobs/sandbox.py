"""The Jinja2 environment every sbatch template loads and renders in: a sandbox, with bounds.

A spec's ``template:`` is code from wherever the spec came from, rendered on the machine that
runs ``ddpkit submit`` (``--dry-run`` included), where a plain ``jinja2.Environment`` lets it
reach Python's internals and run commands or read the environment. Here:

- ``ImmutableSandboxedEnvironment``: no ``_`` or Python-internal attributes (nor through
  ``str.format``), no changing the context; a violation raises ``SecurityError``.
- ``*`` and ``**`` are checked before they run: ``'x' * 10**12`` or ``7 ** 10**9`` would
  exhaust memory or CPU in one expression.
- the rendered text is collected up to :data:`MAX_SCRIPT_CHARS`.
- templates are regular files of at most :data:`MAX_TEMPLATE_BYTES`, and a user's template
  reads only ddpkit's templates and files in its own folder or below, links resolved
  (:func:`confined`): not ``/proc/self/environ`` into a script ``--dry-run`` prints.

A loop's running time is not bounded: rendering runs in the user's own process, where Ctrl-C
ends it. The built-in templates render byte for byte as in a plain environment.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Collection, Iterable, Mapping, Sized
from importlib import resources
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ddpkit.errors import ConfigError
from ddpkit.jobs.spec_checks import shown

__all__ = [
    "MAX_SCRIPT_CHARS",
    "MAX_TEMPLATE_BYTES",
    "SANDBOX_HINT",
    "SecurityError",
    "TemplateTooLong",
    "collect",
    "confined",
    "read_template_file",
    "sandbox_environment",
]

# sbatch refuses scripts over 4 MB by default (max_script_size); a sweep's table can come near
# that, so the bound is well above it: it is against runaway templates, not big jobs.
MAX_SCRIPT_CHARS = 64 * 2**20
MAX_TEMPLATE_BYTES = 2**20
_MAX_INT_BITS = 4096  # a number of ~1200 digits is more than any script needs
SANDBOX_HINT = (
    "ddpkit renders templates in Jinja2's sandbox: no attributes starting with '_' or internal "
    "to Python, no changing the context, no huge values"
)


class TemplateTooLong(jinja2.TemplateRuntimeError):
    """The rendered text passed :data:`MAX_SCRIPT_CHARS`."""


def _check_binop(operator: str, left: object, right: object) -> None:
    """Refuse ``*`` and ``**`` whose result would be huge, before computing it."""
    if operator == "**":
        if (
            isinstance(left, int)
            and isinstance(right, int)
            and left not in (-1, 0, 1)
            and right * left.bit_length() > _MAX_INT_BITS
        ):
            raise SecurityError(f"{left} ** {right} is too big (over {_MAX_INT_BITS} bits)")
        return
    for seq, count in ((left, right), (right, left)):
        if (
            isinstance(seq, Sized)
            and isinstance(count, int)
            and len(seq) * count > MAX_SCRIPT_CHARS
        ):
            raise SecurityError(
                f"a {type(seq).__name__} of length {len(seq)} * {count} is too long "
                f"(over {MAX_SCRIPT_CHARS} items)"
            )


class _SbatchSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)


def read_template_file(path: str) -> str:
    """The text of a template file: a regular file of at most :data:`MAX_TEMPLATE_BYTES`
    (``/dev/zero`` or a FIFO would never end). Raises OSError or UnicodeDecodeError."""
    with open(path, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(0, "not a regular file")
        data = file.read(MAX_TEMPLATE_BYTES + 1)
    if len(data) > MAX_TEMPLATE_BYTES:
        raise OSError(0, f"larger than {MAX_TEMPLATE_BYTES} bytes")
    return data.decode("utf-8")


def _loader(builtin: Collection[str], top: str | None) -> jinja2.BaseLoader:
    """A built-in template by file name (ddpkit/templates/), the user's template ``top`` by its
    path, and any other name (``{% include %}``, ``{% import %}``, ``{% extends %}``) as a file
    of ``top``'s folder (see :func:`confined`)."""
    root = None if top is None else os.path.dirname(top)

    def load(name: str) -> tuple[str, str, Callable[[], bool]]:
        if name in builtin:
            resource = resources.files("ddpkit") / "templates" / name
            return resource.read_text(encoding="utf-8"), str(resource), lambda: True
        path = name if name == top else confined(name, root)
        try:
            source = read_template_file(path)
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) else str(err)
            raise ConfigError(
                f"template={shown(name)} cannot be read: {reason}",
                hint="give the path of a Jinja2 sbatch template (absolute, or relative to "
                "workdir), or drop `template` to use the built-in one",
            ) from err
        return source, path, lambda: False

    return jinja2.FunctionLoader(load)


def confined(name: str, root: str | None) -> str:
    """The file ``name`` (relative to ``root``, the user's template's folder) when it lies in
    that folder once links are resolved; else a ConfigError. A template renders on the machine
    that runs ``ddpkit submit``: reading ``/proc/self/environ``, a key or a file of another
    folder into the script (which ``--dry-run`` prints) would read that machine."""
    path = os.path.join(root or "", name)
    if root is not None:
        real_root = os.path.realpath(root)
        real = os.path.realpath(path)
        if os.path.commonpath([real_root, real]) == real_root:
            return path
    raise ConfigError(
        f"template {shown(name)} is outside the template's folder"
        + (f" {shown(root, quote=False)}" if root is not None else ""),
        hint="a template may include, import or extend ddpkit's templates and the files of its "
        "own folder and below (links resolved): copy the file there",
    )


def sandbox_environment(
    builtin: Collection[str], filters: Mapping[str, Callable[..., str]], top: str | None = None
) -> jinja2.Environment:
    """The sandbox with ddpkit's settings: the ``builtin`` template names load from the
    package, the user's template ``top`` (an absolute path) and the files of its folder from
    disk, strict undefined, no autoescape (shell, not HTML: the ``filters`` quote),
    whitespace control as the built-in templates expect."""
    env = _SbatchSandbox(
        loader=_loader(builtin, top),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(filters)
    return env


def collect(chunks: Iterable[str]) -> str:
    """The rendered ``chunks`` joined, or TemplateTooLong once they pass
    :data:`MAX_SCRIPT_CHARS` characters."""
    parts: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_SCRIPT_CHARS:
            raise TemplateTooLong(f"the script is longer than {MAX_SCRIPT_CHARS} characters")
        parts.append(chunk)
    return "".join(parts)
