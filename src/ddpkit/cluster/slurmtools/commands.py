"""What ddpkit asks SLURM to do to a job: submit (``sbatch``), cancel (``scancel``), requeue
(``scontrol requeue``), and the one waiting loop of every backend (:func:`poll_until_finished`).
Every command goes through a :class:`~.runner.Runner`.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ddpkit.cluster.slurmtools.query import NOT_FOUND, is_job_id, parse_job_id
from ddpkit.cluster.slurmtools.runner import (
    Runner,
    SlurmError,
    first_line,
    lines,
    subprocess_runner,
)
from ddpkit.cluster.slurmtools.states import JobStatus
from ddpkit.errors import ConfigError

__all__ = ["cancel", "poll_until_finished", "requeue", "submit_script"]


def submit_script(
    text: str,
    *,
    cwd: str | os.PathLike[str],
    runner: Runner = subprocess_runner,
    env: Mapping[str, str] | None = None,
) -> str:
    """Submit a batch script given as text (``sbatch --parsable``, script on stdin); its job id.

    ``cwd`` becomes the job's working directory (``--chdir``), against which relative
    ``#SBATCH --output`` paths resolve.
    """
    workdir = Path(cwd).resolve()
    if not workdir.is_dir():
        raise ConfigError(
            f"cwd={os.fspath(cwd)!r} is not a directory", hint="submit from an existing directory"
        )
    argv = ["sbatch", "--parsable", f"--chdir={workdir}"]
    done = runner(argv, stdin=text, env=env)
    if done.returncode != 0:
        message = " ".join(lines(done.stderr)) or "(no message)"
        raise SlurmError(
            f"`{shlex.join(argv)}` failed with exit code {done.returncode}: {message}",
            hint="the message is sbatch's own; compare the #SBATCH lines with `sinfo`",
        )
    answer = (lines(done.stdout) or [""])[-1]
    job_id = answer.split(";", 1)[0]  # --parsable prints "id" or "id;cluster"
    if not is_job_id(job_id):
        raise SlurmError(
            f"`{shlex.join(argv)}` printed {done.stdout!r}, not a job id",
            hint="an sbatch wrapper may be printing extra lines; call SLURM's own sbatch",
        )
    return job_id


def cancel(
    job_id: str | int, *, runner: Runner = subprocess_runner, env: Mapping[str, str] | None = None
) -> None:
    """Cancel ``job_id`` (``scancel``); a job that already ended is left alone.

    ``scancel`` exits 0 even for an unknown id and only says so with ``--verbose``.
    """
    job = parse_job_id(job_id)
    argv = ["scancel", "--verbose", job]
    done = runner(argv, env=env)
    if any(text in done.stderr for text in NOT_FOUND):
        raise ConfigError(
            f"job_id={job!r} is not known to SLURM (`{shlex.join(argv)}`)",
            hint="check the id with `squeue`; SLURM forgets finished jobs after MinJobAge",
        )
    if done.returncode != 0:
        raise SlurmError(
            f"`{shlex.join(argv)}` failed with exit code {done.returncode}: "
            f"{first_line(done.stderr)}",
            hint="is the controller up? `scontrol ping` tells",
        )


def requeue(target: str, *, runner: Runner = subprocess_runner) -> str | None:
    """``scontrol requeue <target>``: None on success, else why it failed (never raises: the
    caller, a stopping job, reports it and exits with its own code)."""
    argv = ["scontrol", "requeue", target]
    try:
        done = runner(argv)
    except SlurmError as error:
        return f"{shlex.join(argv)} could not run ({error.message})"
    if done.returncode != 0:
        output = " ".join((done.stderr or done.stdout).split())[:300]
        return f"{shlex.join(argv)} failed with exit code {done.returncode}: {output}"
    return None


def poll_until_finished(
    query: Callable[[], JobStatus],
    job: str,
    timeout_s: float,
    poll_s: float = 1.0,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> JobStatus:
    """Ask ``query`` every ``poll_s`` until the job is finished; its final status. The one
    waiting loop of every backend; a SlurmError naming ``job`` after ``timeout_s``."""
    deadline = clock() + timeout_s
    while True:
        status = query()
        if status.state.is_finished:
            return status
        if clock() >= deadline:
            raise SlurmError(
                f"job {job} is still {status.state.value} after timeout_s={timeout_s:g}",
                hint=status.hint or f"wait longer, or stop it with `ddpkit cancel {job}`",
            )
        sleep(poll_s)
