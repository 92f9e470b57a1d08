"""``ddpkit plan|submit|status|logs|cancel``: YAML job specs on SLURM, from the command line.

This module owns the argparse side of the job subcommands and what they print. Arguments become
a :class:`JobsRequest` in one place (:func:`request_from_args`); the jobs API, and with it
pydantic, Jinja2 and submitit, is imported only after parsing, so ``ddpkit --help`` stays cheap.
stdout carries only the result (``JOB=$(ddpkit submit spec.yaml)`` works); notes go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddpkit.cli import add_command
from ddpkit.cluster.slurmtools import JobState, JobStatus
from ddpkit.jobs.backends import BACKENDS, check_scheduler
from ddpkit.jobs.interrupts import held_stop_signals
from ddpkit.jobs.records import Via, parse_job
from ddpkit.launch.config import parse_int

if TYPE_CHECKING:
    from ddpkit.jobs.backends import SweepTask
    from ddpkit.jobs.load import ResolvedSpec
    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "JobsRequest",
    "add_parsers",
    "describe_status",
    "describe_sweep",
    "request_from_args",
    "run_jobs_command",
]

_SPEC_HELP = "YAML job spec (name, command, nodes, ...); `ddpkit plan SPEC` shows it resolved"
_SET_HELP = "override a spec field: --set nodes=2 --set env.FOO=bar (repeatable; beats the spec)"
_SWEEP_HELP = (
    "run the job once per value (repeatable: a grid; --set sweep.mode=zip pairs them up), "
    "e.g. --sweep lr=0.1,0.01 --sweep seed=1,2; replaces the spec's sweep params; the command "
    "reads {lr}, every rank DDPKIT_SWEEP_LR"
)
_AFTER_HELP = (
    "wait for this job (a name or job id; repeatable): the spec's after: list, which it "
    "replaces; --set after_type=afterany to start once they ended, whatever their state"
)

_SUBMIT_EPILOG = """\
stdout is only the job id, so JOB=$(ddpkit submit job.yaml) works; the job is recorded under
$DDPKIT_HOME/jobs (default ~/.cache/ddpkit) for status, logs and cancel.
examples:
  ddpkit submit job.yaml --set nodes=2
  ddpkit submit job.yaml --dry-run              # the exact sbatch script; nothing is submitted
  ddpkit submit job.yaml --via submitit --dry-run
  ddpkit submit job.yaml --via torchx --scheduler slurm --dry-run   # torchx's sbatch script
  ddpkit submit job.yaml --sweep lr=0.1,0.01 --sweep seed=1,2   # one array of 4 runs
  ddpkit submit eval.yaml --after train      # starts once the newest job "train" COMPLETED
a sweep prints the array's job id JOB; `ddpkit status JOB` shows every run, JOB_3 one run.
via torchx (pip install ddpkit[torchx]) the job id is torchx's app handle, e.g.
slurm://torchx/1234 (the SLURM job id 1234 names it too) or local_cwd://torchx/demo-x7k2.
--scheduler local_cwd (the default) runs the job on this machine in the foreground: submit
returns when it has ended (exit 1 unless it succeeded; Ctrl-C or SIGTERM cancels it).
"""
_LOGS_EPILOG = """\
--follow prefixes each line with its file ("[rank 3] ...") and never mixes two ranks' lines.
A sweep: JOB_3 is one run (its rank files are in <log_dir>/<run>/); JOB every run's files.
srun jobs write one file per rank (<log_dir>/<name>-<id>-rank<N>.out); torchrun jobs one per
node whose lines start with "[rankN]: " (--rank N keeps those lines); submitit jobs
<log_dir>/<id>_<N>_log.out. Without --rank: the batch output, then every file with a header.
torchx jobs: torchx's files per replica (one per node; slurm: slurm-<id>-<role>-<k>.out/.err in
the submitting directory); --rank N keeps the "[rankN]: " lines of every replica's files (the
rendezvous, not the replica index, decides which node a rank is on).
"""


@dataclass(frozen=True)
class JobsRequest:
    """One job subcommand's arguments, checked and typed."""

    command: str  # plan | submit | status | logs | cancel
    spec_path: str | None = None
    overrides: tuple[str, ...] = ()
    sweeps: tuple[str, ...] = ()
    via: Via = "sbatch"
    scheduler: str | None = None  # torchx's scheduler (via torchx only)
    dry_run: bool = False
    job_id: str | None = None
    rank: int | None = None
    follow: bool = False


def request_from_args(args: argparse.Namespace) -> JobsRequest:
    """The only place where argparse values become a request (job id and rank are checked)."""
    job, rank = getattr(args, "job", None), getattr(args, "rank", None)
    # --rank: ASCII digits (argparse's int read ٣ as 3 and 1_0 as 10)
    rank = None if rank is None else parse_int(rank, "--rank", minimum=0)
    via: Via = getattr(args, "via", None) or "sbatch"
    scheduler = getattr(args, "scheduler", None)
    check_scheduler(via, scheduler, flags=True)
    return JobsRequest(
        command=args.command,
        spec_path=getattr(args, "spec", None),
        overrides=tuple(getattr(args, "overrides", None) or ()) + _chain_overrides(args),
        sweeps=tuple(getattr(args, "sweeps", None) or ()),
        via=via,
        scheduler=scheduler,
        dry_run=bool(getattr(args, "dry_run", False)),
        job_id=None if job is None else parse_job(job),
        rank=rank,
        follow=bool(getattr(args, "follow", False)),
    )


def _chain_overrides(args: argparse.Namespace) -> tuple[str, ...]:
    """``--after``/``--singleton`` as the ``--set`` overrides they stand for (after the user's
    own, so the flags win); the spec checks the values as it checks any."""
    after: list[str] = getattr(args, "after", None) or []
    chain = (f"after={json.dumps(after)}",) if after else ()
    return chain + (("singleton=true",) if getattr(args, "singleton", False) else ())


def _add(commands: Any, name: str, text: str) -> argparse.ArgumentParser:
    return add_command(commands, name, text, run_jobs_command)


def add_parsers(commands: Any) -> None:
    """Register the job subcommands on the top-level ``add_subparsers()`` object."""
    plan = _add(commands, "plan", "show the resolved job spec and its rank layout")
    _spec_arguments(plan)
    submit = _add(commands, "submit", "submit a job spec to SLURM; print the job id")
    submit.epilog = _SUBMIT_EPILOG
    _spec_arguments(submit)
    submit.add_argument(
        "--via",
        choices=tuple(BACKENDS),
        default="sbatch",
        help="plain sbatch script (default), submitit's executor, or torchx's runner",
    )
    submit.add_argument(
        "--scheduler",
        choices=("local_cwd", "slurm"),
        default=None,
        help="torchx's scheduler, with --via torchx only (default local_cwd: this machine)",
    )
    submit.add_argument(
        "--dry-run",
        action="store_true",
        help="print exactly what would be submitted (script, submitit parameters, torchx dryrun)",
    )
    status = _add(
        commands,
        "status",
        "print a job's state (and exit code when known), then its run id and attempt; a "
        "sweep's array id: one row per task with its state, attempt and run id",
    )
    _job_argument(status)
    logs = _add(commands, "logs", "print a job's output files")
    logs.epilog = _LOGS_EPILOG
    _job_argument(logs)
    logs.add_argument("--rank", default=None, metavar="N", help="only rank N's output")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new output until the job ends"
    )
    cancel = _add(commands, "cancel", "cancel a job (every step and process of it)")
    _job_argument(cancel)


def _spec_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help=_SPEC_HELP)
    for flag, dest, metavar, text in (
        ("--set", "overrides", "KEY=VALUE", _SET_HELP),
        ("--sweep", "sweeps", "NAME=V1,V2", _SWEEP_HELP),
        ("--after", "after", "JOB", _AFTER_HELP),
    ):
        parser.add_argument(
            flag, dest=dest, action="append", default=[], metavar=metavar, help=text
        )
    parser.add_argument(
        "--singleton",
        action="store_true",
        help="one job of this name of yours at a time (--set singleton=true)",
    )


def _job_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "job", metavar="JOB", help="SLURM job id or torchx app handle (as `ddpkit submit` printed)"
    )


def run_jobs_command(args: argparse.Namespace) -> int:
    """Handler of every job subcommand: type the arguments, then import the API and act."""
    request = request_from_args(args)
    if request.command in ("plan", "submit"):
        return _spec_command(request)
    if request.command == "logs":
        return _logs(request)
    from ddpkit.jobs import api

    job_id = request.job_id or ""
    if request.command == "cancel":
        api.cancel(job_id)
        return 0
    tasks = api.sweep_status(job_id)
    if tasks is not None:
        print(describe_sweep(tasks))
        return 1 if all(task.status.state is JobState.UNKNOWN for task in tasks) else 0
    status = api.status(job_id)
    print(describe_status(status))
    run = api.run_of(job_id)
    if run is not None:  # the ranks' run id, and SLURM's requeue count while it knows the job
        print(f"run {run.run_id}" + ("" if run.attempt is None else f" attempt {run.attempt}"))
    if status.hint:
        print(f"ddpkit: {status.hint}", file=sys.stderr)
    return 1 if status.state is JobState.UNKNOWN else 0


def _spec_command(request: JobsRequest) -> int:
    from ddpkit.jobs import api

    resolved = api.resolve(request.spec_path or "", request.overrides, sweeps=request.sweeps)
    spec = resolved.spec
    _warn_unused_sweep_parameters(spec)
    if request.command == "plan":
        _write(api.plan(spec, resolved.profile_path))
        return 0
    if request.dry_run:
        _write(api.dry_run(spec, request.via, scheduler=request.scheduler))
        _say_profile(resolved)
        return 0
    wanted = api.request(spec, request.via, scheduler=request.scheduler)
    with held_stop_signals(enabled=not wanted.foreground):  # a job submitted has its id printed
        record = api.schedule(wanted)
        print(record.name_for_user, flush=True)
    _say_profile(resolved)
    for note in wanted.notes:  # after success, as the profile line: an error stays one line
        print(f"ddpkit: {note}", file=sys.stderr)
    if record.final_state is not None:  # a local torchx app has run in the foreground
        print(f"ddpkit: {record.name_for_user} ended {record.final_state}", file=sys.stderr)
        return 0 if record.final_state == "SUCCEEDED" else 1
    return 0


def _say_profile(resolved: ResolvedSpec) -> None:
    """Name the profile file on stderr (plan prints it; stdout here is the script or the job
    id): its ``setup:`` lines ran or will run in the job. Said after success only, so that an
    error stays one line."""
    if resolved.profile_path is not None:
        from ddpkit.jobs.layout import profile_line

        line = profile_line(resolved.spec, resolved.profile_path)
        print(f"ddpkit: {line}", file=sys.stderr)


def _warn_unused_sweep_parameters(spec: JobSpec) -> None:
    """A parameter the command never names is a sweep whose runs may all be the same run: say
    so (a warning, not an error: the script may read ``DDPKIT_SWEEP_<NAME>`` itself)."""
    if spec.sweep is None:
        return
    from ddpkit.jobs.sweep import value_var
    from ddpkit.jobs.sweep_spec import unused_parameters

    for name in unused_parameters(spec.command, spec.sweep):
        print(
            f"ddpkit: warning: sweep parameter {name!r} is not a {{{name}}} placeholder in "
            f"command: its values reach the ranks only as ${value_var(name)} (add e.g. "
            f"'--{name} {{{name}}}' to command, unless the script reads that variable)",
            file=sys.stderr,
        )


def describe_status(status: JobStatus) -> str:
    """``COMPLETED (exit code 0)``: the state, then what SLURM knows of how it ended."""
    ending = []
    if status.exit_code is not None:
        ending.append(f"exit code {status.exit_code}")
    if status.signal:
        ending.append(f"signal {status.signal}")
    return f"{status.state.name} ({', '.join(ending)})" if ending else status.state.name


def describe_sweep(tasks: list[SweepTask]) -> str:
    """A sweep's runs, one line each (task id, state and how it ended, attempt, run id, run
    name; ``-`` where not known), and a count of runs per state: readable for a thousand tasks
    as for four."""
    from ddpkit.jobs.layout import format_table

    rows = [
        [
            task.task,
            describe_status(task.status),
            "-" if task.attempt is None else str(task.attempt),
            task.run_id or "-",
            task.run,
        ]
        for task in tasks
    ]
    counts = Counter(task.status.state.name for task in tasks)
    summary = ", ".join(f"{count} {state}" for state, count in counts.items())
    table = format_table(["task", "state", "attempt", "run id", "run"], rows)
    return f"{table}\n# {len(tasks)} runs: {summary}"


def _logs(request: JobsRequest) -> int:
    from ddpkit.jobs import api

    job_id = request.job_id or ""
    if request.follow:
        try:
            for chunk in api.follow_logs(job_id, request.rank):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        except KeyboardInterrupt:
            return 130
        return 0
    logs = api.read_logs(job_id, request.rank)
    if not logs.files:
        print(f"ddpkit: no output files of job {job_id}; looked for {logs.looked}", file=sys.stderr)
        return 1
    sys.stdout.write(logs.text)
    return 0


def _write(text: str) -> None:
    """Print ``text`` exactly: a dry run must be byte for byte what would be submitted."""
    sys.stdout.write(text)
    sys.stdout.flush()
