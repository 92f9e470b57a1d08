"""SLURM's command-line tools behind one seam: submit, query, cancel and wait for batch jobs.

This module owns

* the :class:`Runner` seam: every ``sbatch``/``squeue``/``sacct``/``scontrol``/``scancel`` call goes
  through a callable ``runner(argv, stdin=..., env=...) -> CommandResult``, so tests can replace
  the cluster (or one tool of it) without patching;
* :class:`JobState` and the ONE table (:data:`SLURM_STATES`) from SLURM's state strings (long names,
  ``squeue``'s short codes, ``sacct``'s ``CANCELLED by 0`` and truncated ``CANCELLED+``) to it;
* the query order of :func:`query_state`: ``squeue`` (live jobs) -> ``sacct`` (accounting) ->
  ``scontrol show job`` (recently finished jobs, no accounting needed) -> ``UNKNOWN`` with a hint.

Job ids are strings: ``123``, array tasks ``123_4`` and heterogeneous components ``123+0``.
Nothing here imports torch or writes ``os.environ``; ``env=None`` means the caller's environment.
"""

from __future__ import annotations

import enum
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

from ddpkit.errors import ConfigError, SchedulerError

__all__ = [
    "SLURM_STATES",
    "CommandResult",
    "JobState",
    "JobStatus",
    "Row",
    "Runner",
    "SlurmError",
    "cancel",
    "covers",
    "parse_job_id",
    "poll_until_finished",
    "query_state",
    "row_status",
    "state_from_slurm",
    "submit_script",
    "subprocess_runner",
    "tool_rows",
    "wait",
]

COMMAND_TIMEOUT_S = 60.0


# The scheduler error of the package-wide tree, under the name this module's callers use.
SlurmError = SchedulerError


class CommandResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


class Runner(Protocol):
    """Runs ``argv`` with ``stdin`` text and the full environment ``env`` (None: inherit)."""

    def __call__(
        self, argv: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
    ) -> CommandResult: ...


def subprocess_runner(
    argv: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
) -> CommandResult:
    """The real :class:`Runner`: ``subprocess.run`` with a timeout; errors as SlurmError."""
    command = shlex.join(argv)
    try:
        done = subprocess.run(
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            env=None if env is None else dict(env),
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError as exc:
        raise SlurmError(
            f"command {argv[0]!r} not found (running `{command}`)",
            hint="install SLURM's client tools (Debian: slurm-client) or put them on PATH",
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(
            f"`{command}` did not answer within {COMMAND_TIMEOUT_S:g} s",
            hint="is the controller up? `scontrol ping` tells",
        ) from exc
    return CommandResult(done.returncode, done.stdout, done.stderr)


class JobState(enum.Enum):
    """Where a job is in its life; SLURM's many strings map onto these by :data:`SLURM_STATES`.

    PENDING -> CONFIGURING -> RUNNING -> COMPLETING -> one finished state (COMPLETED, FAILED,
    CANCELLED, TIMEOUT, PREEMPTED, NODE_FAIL, OUT_OF_MEMORY, BOOT_FAIL, DEADLINE). RUNNING can go
    to SUSPENDED and back; a requeued job goes through REQUEUED back to PENDING. COMPLETING is not
    finished: processes of the job may still be exiting. UNKNOWN: no tool knows the job (or SLURM
    printed a state this table lacks) - also not finished.
    """

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    REQUEUED = "REQUEUED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    SUSPENDED = "SUSPENDED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    UNKNOWN = "UNKNOWN"

    @property
    def is_finished(self) -> bool:
        """True once the job has ended for good and none of its processes is left."""
        return self in _FINISHED


_S = JobState
_FINISHED = frozenset({
    _S.COMPLETED, _S.FAILED, _S.CANCELLED, _S.TIMEOUT, _S.PREEMPTED, _S.NODE_FAIL,
    _S.OUT_OF_MEMORY, _S.BOOT_FAIL, _S.DEADLINE,
})  # fmt: skip
# SLURM 22.05+ state names (squeue %T, sacct State, scontrol JobState) and squeue's %t codes.
SLURM_STATES: Mapping[str, JobState] = {
    **{state.value: state for state in JobState if state is not JobState.UNKNOWN},
    "REQUEUE_HOLD": _S.REQUEUED,  # requeued and held until released
    "REQUEUE_FED": _S.REQUEUED,
    "SPECIAL_EXIT": _S.REQUEUED,  # requeued (held) after a site-chosen exit code
    "RESV_DEL_HOLD": _S.PENDING,  # held because its reservation was deleted
    "RESIZING": _S.RUNNING,
    "SIGNALING": _S.RUNNING,
    "STAGE_OUT": _S.COMPLETING,  # burst buffer stage-out after the processes ended
    "STOPPED": _S.SUSPENDED,  # SIGSTOPped, keeps its resources
    "REVOKED": _S.CANCELLED,  # federation: a sibling job started elsewhere
    "PD": _S.PENDING, "CF": _S.CONFIGURING, "R": _S.RUNNING, "CG": _S.COMPLETING,
    "CD": _S.COMPLETED, "F": _S.FAILED, "CA": _S.CANCELLED, "TO": _S.TIMEOUT,
    "PR": _S.PREEMPTED, "RQ": _S.REQUEUED, "NF": _S.NODE_FAIL, "OOM": _S.OUT_OF_MEMORY,
    "S": _S.SUSPENDED, "BF": _S.BOOT_FAIL, "DL": _S.DEADLINE, "RH": _S.REQUEUED,
    "RF": _S.REQUEUED, "SE": _S.REQUEUED, "RD": _S.PENDING, "RS": _S.RUNNING,
    "SI": _S.RUNNING, "SO": _S.COMPLETING, "ST": _S.SUSPENDED, "RV": _S.CANCELLED,
}  # fmt: skip
_LONG_NAMES = sorted(name for name in SLURM_STATES if len(name) > 3)


def state_from_slurm(raw: str) -> JobState:
    """Map any state string SLURM prints to a :class:`JobState`; unknown strings give UNKNOWN.

    ``sacct`` appends who cancelled (``CANCELLED by 0``) and, in fixed-width output, truncates
    with ``+`` (``CANCELLED+``, ``OUT_OF_ME+``): both are understood.
    """
    text = re.sub(r"\s+BY\s+\S+$", "", raw.strip().upper())
    if text in SLURM_STATES:
        return SLURM_STATES[text]
    if text.endswith("+"):
        states = {SLURM_STATES[name] for name in _LONG_NAMES if name.startswith(text[:-1])}
        if len(states) == 1:
            return states.pop()
    return JobState.UNKNOWN


Source = Literal["squeue", "sacct", "scontrol", "torchx", "none"]


@dataclass(frozen=True)
class JobStatus:
    """One answer about a job: the mapped state, SLURM's own string, and who said so.

    ``exit_code``/``signal`` come from ``sacct``/``scontrol`` (``ExitCode=3:0``); ``squeue`` has
    none. ``hint`` explains an UNKNOWN state.
    """

    state: JobState
    raw: str
    exit_code: int | None
    source: Source
    signal: int | None = None
    hint: str | None = None


_JOB_ID = re.compile(r"\d+(?:_\d+|\+\d+)?")


def parse_job_id(job_id: str | int) -> str:
    """Validate a job id (``123``, array task ``123_4``, heterogeneous component ``123+0``)."""
    text = str(job_id).strip()
    if not _JOB_ID.fullmatch(text):
        raise ConfigError(
            f"job_id={job_id!r} is not a SLURM job id",
            hint="a number like 123, an array task like 123_4 or a component like 123+0",
        )
    return text


class Row(NamedTuple):
    job_id: str  # as the tool prints it: 123, 123_4, 123_[5-10], 123+0
    raw: str
    exit_code: int | None
    signal: int | None


def _exit_code(text: str) -> tuple[int | None, int | None]:
    code, _, sig = text.partition(":")
    if code.isdigit() and sig.isdigit():
        return int(code), int(sig)
    return None, None


def covers(shown: str, job_id: str) -> bool:
    """Whether a pending-array row like ``123_[5-10:2,12%4]`` stands for the task ``job_id``."""
    base, _, task = job_id.partition("_")
    match = re.fullmatch(re.escape(base) + r"_\[([0-9,:\-]+)(?:%\d+)?\]", shown)
    if not task or match is None:
        return False
    number = int(task)
    for part in match.group(1).split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?(?::(\d+))?", part)
        if bounds is not None:
            low, step = int(bounds.group(1)), max(int(bounds.group(3) or 1), 1)
            if low <= number <= int(bounds.group(2) or low) and (number - low) % step == 0:
                return True
    return False


def _select(rows: Sequence[Row], job_id: str) -> Row | None:
    """The row answering for ``job_id``: its own, else (for a plain id) the most telling part.

    A live array task or het component means the job is not over (the most advanced live one
    is reported); once all are finished, the first that did not complete is, so a failure shows.
    """
    own = [row for row in rows if row.job_id == job_id or covers(row.job_id, job_id)]
    if own or not job_id.isdigit():
        return own[0] if own else None
    parts = [row for row in rows if re.split(r"[_+]", row.job_id)[0] == job_id]
    if not parts:  # asked by the raw id of one array task, the tool shows it as 123_4
        return rows[0] if len(rows) == 1 else None
    live = [row for row in parts if not state_from_slurm(row.raw).is_finished]
    if live:  # squeue lists pending tasks first; one running task means the job runs
        return min(live, key=lambda row: _LIVE_RANK.get(state_from_slurm(row.raw), 9))
    failed = [row for row in parts if state_from_slurm(row.raw) is not JobState.COMPLETED]
    return (failed or parts)[0]


_LIVE = [_S.RUNNING, _S.COMPLETING, _S.CONFIGURING, _S.SUSPENDED, _S.REQUEUED, _S.PENDING]
_LIVE_RANK = {state: rank for rank, state in enumerate(_LIVE)}


_NOT_FOUND = ("Invalid job id specified",)


def _squeue_rows(stdout: str) -> list[Row]:
    return [Row(*line.partition("|")[::2], None, None) for line in _lines(stdout)]


def _sacct_rows(stdout: str) -> list[Row]:
    fields = [line.split("|") for line in _lines(stdout)]
    return [Row(row[0], row[1], *_exit_code(row[2])) for row in fields if len(row) == 3]


_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")


def _scontrol_row(line: str) -> Row:
    """``Key=value`` pairs of one ``scontrol --oneliner`` line (values may hold spaces)."""
    keys = list(_SCONTROL_KEY.finditer(line))
    ends = [match.start() for match in keys[1:]] + [len(line)]
    pairs = zip(keys, ends, strict=True)
    fields = {key.group(1): line[key.end() : end].strip() for key, end in pairs}
    job_id = fields.get("JobId", "")
    task = fields.get("ArrayTaskId", "N/A")
    if task != "N/A" and "ArrayJobId" in fields:
        job_id = f"{fields['ArrayJobId']}_{task if task.isdigit() else f'[{task}]'}"
    elif "HetJobOffset" in fields and "HetJobId" in fields:
        job_id = f"{fields['HetJobId']}+{fields['HetJobOffset']}"
    return Row(job_id, fields.get("JobState", ""), *_exit_code(fields.get("ExitCode", "")))


# per tool: the command (the job id is appended), its output parser, what "no row" means
_TOOLS: dict[Source, tuple[list[str], Callable[[str], list[Row]], str]] = {
    "squeue": (
        ["squeue", "--noheader", "--array", "--format", "%i|%T", "--jobs"],
        _squeue_rows,
        "not listed",
    ),
    "sacct": (
        ["sacct", "--allocations", "--noheader", "--parsable2", "-oJobID,State,ExitCode", "-j"],
        _sacct_rows,
        "no record",
    ),
    "scontrol": (
        ["scontrol", "show", "job", "--oneliner"],
        lambda stdout: [_scontrol_row(line) for line in _lines(stdout)],
        "forgotten or never known",
    ),
}


def tool_rows(
    source: Source, job_id: str, runner: Runner, env: Mapping[str, str] | None
) -> tuple[list[Row], str]:
    """One tool's rows about the job (and its array tasks), or none and why."""
    argv, parse, no_row = _TOOLS[source]
    done = runner([*argv, job_id], env=env)
    if done.returncode != 0:
        not_found = any(text in done.stderr for text in _NOT_FOUND)
        return [], no_row if not_found else f"failed: {_first_line(done.stderr)}"
    return parse(done.stdout), no_row


def row_status(row: Row, source: Source) -> JobStatus:
    return JobStatus(state_from_slurm(row.raw), row.raw, row.exit_code, source, row.signal)


def _ask(
    source: Source, job_id: str, runner: Runner, env: Mapping[str, str] | None
) -> tuple[JobStatus | None, str]:
    """One tool's status of the job, or None and why it has none."""
    rows, no_row = tool_rows(source, job_id, runner, env)
    if not rows:
        return None, no_row
    row = _select(rows, job_id)
    if row is None:
        return None, no_row
    return row_status(row, source), ""


def query_state(
    job_id: str | int, *, runner: Runner = subprocess_runner, env: Mapping[str, str] | None = None
) -> JobStatus:
    """The state of ``job_id``: squeue (live) -> sacct (accounting) -> scontrol -> UNKNOWN.

    ``sacct`` lags ``squeue`` by a second or two, so a job ``squeue`` no longer lists but
    ``sacct`` still calls live is asked of ``scontrol`` too. Without accounting (``sacct`` fails)
    ``scontrol`` answers for as long as the controller remembers the job (``MinJobAge``).
    """
    job = parse_job_id(job_id)
    live, why_squeue = _ask("squeue", job, runner, env)
    if live is not None:
        return live
    accounted, why_sacct = _ask("sacct", job, runner, env)
    if accounted is not None and accounted.state.is_finished:
        return accounted
    recent, why_scontrol = _ask("scontrol", job, runner, env)
    if recent is not None:
        return recent
    if accounted is not None:
        return accounted
    hint = f"job {job}: squeue {why_squeue}; sacct {why_sacct}; scontrol {why_scontrol}. "
    hint += "Check the id; without accounting SLURM forgets a job MinJobAge seconds after it ends"
    return JobStatus(JobState.UNKNOWN, "", None, "none", hint=hint)


def submit_script(
    text: str,
    *,
    cwd: str | os.PathLike[str],
    runner: Runner = subprocess_runner,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
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
    argv = ["sbatch", "--parsable", f"--chdir={workdir}", *extra_args]
    done = runner(argv, stdin=text, env=env)
    if done.returncode != 0:
        message = " ".join(_lines(done.stderr)) or "(no message)"
        raise SlurmError(
            f"`{shlex.join(argv)}` failed with exit code {done.returncode}: {message}",
            hint="the message is sbatch's own; compare the #SBATCH lines with `sinfo`",
        )
    answer = (_lines(done.stdout) or [""])[-1]
    job_id = answer.split(";", 1)[0]  # --parsable prints "id" or "id;cluster"
    if not _JOB_ID.fullmatch(job_id):
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
    if any(text in done.stderr for text in _NOT_FOUND):
        raise ConfigError(
            f"job_id={job!r} is not known to SLURM (`{shlex.join(argv)}`)",
            hint="check the id with `squeue`; SLURM forgets finished jobs after MinJobAge",
        )
    if done.returncode != 0:
        raise SlurmError(
            f"`{shlex.join(argv)}` failed with exit code {done.returncode}: "
            f"{_first_line(done.stderr)}",
            hint="is the controller up? `scontrol ping` tells",
        )


def wait(
    job_id: str | int,
    timeout_s: float,
    poll_s: float = 1.0,
    *,
    runner: Runner = subprocess_runner,
    env: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> JobStatus:
    """Poll :func:`query_state` every ``poll_s`` until the job is finished; its final status."""
    return poll_until_finished(
        lambda: query_state(job_id, runner=runner, env=env),
        str(job_id),
        timeout_s,
        poll_s,
        clock=clock,
        sleep=sleep,
    )


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


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _first_line(text: str) -> str:
    return (_lines(text) or ["(no message)"])[0]
