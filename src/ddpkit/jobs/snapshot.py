"""``snapshot: true``: the job runs the code as it was submitted, requeues included.

Without it, a job runs the files of ``workdir`` as they are when it starts, and a requeued job
as they are then: an edit made after ``ddpkit submit`` (the next experiment's, often) changes
what a queued or requeued job runs. With it, the submission copies the files git tracks under
``workdir`` (as they are on disk, uncommitted edits included) into
``<log_dir>/snapshots/<name>-<time>-<random>/``, and the job's ``workdir`` becomes that copy:
``#SBATCH --chdir``, the script's ``cd``, ``setup:`` lines, a relative ``command`` all see it.
Every attempt runs the same script, so a requeue runs the same copy.

Off by default: it needs ``workdir`` inside a git repository, and what git does not track
(data, a local config, a virtual environment under ``workdir``) is not in the copy, so turning
it on silently would change what some jobs run. The sbatch backend only: submitit pickles its
call at submission already, and torchx's ``workdir`` is its own (both refuse it in one line).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.errors import ConfigError

if TYPE_CHECKING:
    from ddpkit.jobs.spec import JobSpec

__all__ = ["SNAPSHOT_DOC", "copy_tracked", "snapshotted", "tracked_files"]

SNAPSHOT_DOC = (
    "true: copy the files git tracks under workdir into <log_dir>/snapshots/ at submission and "
    "run the job (its requeues too) from that copy (sbatch only)"
)
_GIT_TIMEOUT_S = 120  # listing the files of a very large repository; a hang guard


def snapshotted(spec: JobSpec) -> JobSpec:
    """``spec`` running from a new snapshot folder (not made yet: :func:`copy_tracked` makes it
    at submission): ``workdir`` is the folder; ``log_dir`` and a relative ``template`` are made
    absolute first, so that they still name the originals. Unchanged without ``snapshot``."""
    if not spec.snapshot:
        return spec
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    folder = Path(spec.log_path) / "snapshots" / f"{spec.name}-{stamp}-{secrets.token_hex(3)}"
    update: dict[str, object] = {"workdir": str(folder), "log_dir": spec.log_path}
    if spec.template is not None and not os.path.isabs(spec.template):
        update["template"] = os.path.join(spec.workdir, spec.template)
    return spec.model_copy(update=update)


def tracked_files(workdir: str) -> list[str]:
    """The paths (relative to ``workdir``) of the files git tracks under it."""
    try:
        done = subprocess.run(
            ["git", "-C", workdir, "ls-files", "-z", "--cached", "--", "."],
            capture_output=True, timeout=_GIT_TIMEOUT_S, check=False,
        )  # fmt: skip
    except FileNotFoundError as exc:
        raise ConfigError(
            "snapshot=true needs git (it copies the files git tracks)",
            hint="install git, or set snapshot: false",
        ) from exc
    if done.returncode != 0:
        said = " ".join(done.stderr.decode(errors="replace").split())[:200]
        raise ConfigError(
            f"snapshot=true: workdir {workdir} is not in a git repository ({said})",
            hint="git add the job's files, or set snapshot: false",
        )
    return sorted({name for name in done.stdout.decode().split("\0") if name})


def copy_tracked(source: str, target: str) -> int:
    """Copy the files git tracks under ``source`` into the new folder ``target`` (a symbolic
    link as a link; a tracked file deleted from disk is left out); the number copied."""
    names = tracked_files(source)
    if not names:
        raise ConfigError(
            f"snapshot=true: git tracks no file under workdir {source}",
            hint="git add the job's files, or set snapshot: false",
        )
    Path(target).mkdir(parents=True)
    copied = 0
    for name in names:
        origin, copy = Path(source, name), Path(target, name)
        if not origin.is_symlink() and not origin.is_file():
            continue  # deleted, or a submodule (a folder): not a file to copy
        copy.parent.mkdir(parents=True, exist_ok=True)
        if origin.is_symlink():
            copy.symlink_to(os.readlink(origin))
        else:
            shutil.copy2(origin, copy)
        copied += 1
    return copied
