"""The spec's ``container`` field: the job step's tasks run in an image, under pyxis (srun's
``--container-image``, ``--container-mounts``, ``--container-workdir`` on the step's srun line)
or apptainer (``apptainer exec --bind ... IMAGE`` before each task's argv).

The whole task runs in the image: ddpkit's signal holder (``-m ddpkit.cluster.stop.hold``), the
command, and under ``launch: torchrun`` each node's ``ddpkit run``, all with ``container.python``
(default: the spec's ``python``, the same path inside the image). The batch shell's helpers (the
c10d endpoint, the health check and the exclusion of bad nodes) run on the host with the spec's
``python``, so ddpkit is needed on both.

Every value is checked for the characters of a path or an image reference, with no leading
'-', no ',' (pyxis's list separator) and no whitespace, so none can add an option, a mount or a
line to the script; the renderer shell-quotes them besides.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from ddpkit.jobs.spec_checks import Model, invalid, listed, shown

__all__ = ["CONTAINER_DOC", "Container", "apptainer_prefix", "plan_line", "pyxis_options"]

CONTAINER_DOC = (
    "run the job step's tasks in an image: container: {runtime: pyxis or apptainer, image, "
    "mounts: [SRC:DST[:ro]], workdir, python} (sbatch, submitit; not torchx)"
)
# an image: a path, a registry reference (nvcr.io#nvidia/pytorch:24.01-py3) or a URI (docker://)
_IMAGE = re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_./:@#+~%=-]*")
_PATH = re.compile(r"/[A-Za-z0-9_./+~@%=-]*")
_PYTHON = re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_./+~@%=-]*")
_FLAGS = ("ro", "rw")


def _matching(pattern: re.Pattern[str], what: str, example: str) -> Callable[[str], str]:
    """A validator: the value matches ``pattern`` whole, else a one-line error saying ``what``
    it is not, with ``example`` as the hint."""

    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise invalid(f"has {shown(value)}, {what}", example)
        return value

    return check


_check_image = _matching(
    _IMAGE,
    "not an image path or reference (no spaces, ',' or leading '-')",
    "e.g. image: /images/torch.sqsh, nvcr.io#nvidia/pytorch:24.01-py3 or docker://pytorch/pytorch",
)
_check_path = _matching(
    _PATH, "not an absolute path without spaces, ',' or ':'", "e.g. workdir: /workspace"
)
_check_python = _matching(
    _PYTHON,
    "not an interpreter's path or name (no spaces or leading '-')",
    "e.g. python: /usr/bin/python3, or python: python",
)


def _check_mount(value: str) -> str:
    parts = value.split(":")
    paths, flags = parts, []
    if len(parts) == 3 or (len(parts) == 2 and parts[1] in _FLAGS):
        paths, flags = parts[:-1], parts[-1:]
    if len(paths) > 2 or not all(_PATH.fullmatch(p) for p in paths) or not set(flags) <= {*_FLAGS}:
        raise invalid(
            f"has {shown(value)}, not SRC[:DST][:ro|rw] of absolute paths "
            "(no spaces, ',' or other flags)",
            "e.g. mounts: [/data:/data:ro, /scratch]",
        )
    return ":".join([paths[0], paths[-1], *flags])  # SRC:DST[:FLAGS], as both runtimes read it


Mount = Annotated[str, AfterValidator(_check_mount)]


class Container(Model):
    """Where the job step's tasks run: an image and how it is entered."""

    runtime: Literal["pyxis", "apptainer"] = Field(
        description="pyxis (srun's --container-* options) or apptainer (apptainer exec)"
    )
    image: Annotated[str, AfterValidator(_check_image)] = Field(
        description="a path, registry reference or URI, e.g. image: docker://pytorch/pytorch"
    )
    mounts: Annotated[list[Mount], BeforeValidator(listed)] = Field(
        default_factory=list, description="SRC[:DST][:ro|rw], e.g. mounts: [/data:/data:ro]"
    )
    workdir: Annotated[str, AfterValidator(_check_path)] | None = Field(
        None, description="the tasks' directory in the image, e.g. workdir: /workspace"
    )
    python: Annotated[str, AfterValidator(_check_python)] | None = Field(
        None, description="the interpreter in the image (default: the spec's python)"
    )


def pyxis_options(container: Container | None) -> list[str]:
    """The step's srun options under pyxis (none otherwise)."""
    if container is None or container.runtime != "pyxis":
        return []
    options = [f"--container-image={container.image}"]
    if container.mounts:
        options.append(f"--container-mounts={','.join(container.mounts)}")
    if container.workdir is not None:
        options.append(f"--container-workdir={container.workdir}")
    return options


def apptainer_prefix(container: Container | None) -> list[str]:
    """The words before each task's argv under apptainer (none otherwise)."""
    if container is None or container.runtime != "apptainer":
        return []
    words = ["apptainer", "exec"]
    for mount in container.mounts:
        words += ["--bind", mount]
    if container.workdir is not None:
        words += ["--pwd", container.workdir]
    return [*words, container.image]


def plan_line(container: Container | None, python: str) -> str | None:
    """``ddpkit plan``'s line for the container (None without one)."""
    if container is None:
        return None
    how = " ".join(pyxis_options(container) or apptainer_prefix(container))
    where = "srun " if container.runtime == "pyxis" else ""
    inside = container.python or python
    return f"# container: each task runs in {where}{how} with {inside}; helpers on the host"
