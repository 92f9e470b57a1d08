"""Jobs through torchx: ``ddpkit submit SPEC --via torchx [--scheduler local_cwd|slurm]`` and then
``status``, ``logs``, ``cancel`` of what it printed.

The job id is torchx's app handle (``slurm://torchx/1234``, ``local_cwd://torchx/demo-x7k2``);
its record says how to follow it. Two torchx facts shape what follows:

* ``local_cwd`` runs the app as children of the submitting process and forgets it when that
  process ends (closing a ``Runner`` kills its apps). So a local_cwd submission runs in the
  foreground, like ``torchx run -s local_cwd``: it returns when the app has ended (Ctrl-C or
  SIGTERM cancels it) and records torchx's final state; its output goes to files under the
  spec's ``log_dir``, which outlive the process (see :func:`_runner`, :func:`_run_local`).
* torchx 0.7's slurm ``describe`` asserts on ``sacct``'s ``CANCELLED by <uid>``, and torchx's
  ``status``, ``cancel`` and ``log_lines`` all call it. For a slurm app, whose app id is the SLURM
  job id, ddpkit asks SLURM itself (``ddpkit.cluster.slurmtools``); torchx is asked only when
  SLURM does not know the job, and any exception of torchx becomes an UNKNOWN state with a hint.

Logs are read from the files torchx's ``log_iter`` reads, so ``ddpkit logs -f`` follows them
like any job's. torchx is imported only when a function here needs it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from ddpkit.cluster import slurmtools as slurm
from ddpkit.cluster.slurmtools import JobState, JobStatus
from ddpkit.errors import ConfigError, DdpkitError
from ddpkit.jobs.backends import Request, SweepTask
from ddpkit.jobs.backends.torchx_appdef import import_torchx, scheduler_cfg, spec_to_appdef
from ddpkit.jobs.interrupts import HELD_SIGNALS, held_stop_signals
from ddpkit.jobs.logs import LogFile
from ddpkit.jobs.records import (
    JobRecord,
    Via,
    new_record,
    save_record,
    split_handle,
    submitted_run_id,
)

if TYPE_CHECKING:
    from ddpkit.jobs.spec import JobSpec

__all__ = [
    "BACKEND",
    "DEFAULT_SCHEDULER",
    "SCHEDULERS",
    "TORCHX_STATES",
    "TorchxBackend",
    "record_for",
    "state_from_torchx",
]

SCHEDULERS = ("local_cwd", "slurm")
# local_cwd works anywhere (no cluster needed); `--scheduler slurm` asks for the cluster explicitly
DEFAULT_SCHEDULER = "local_cwd"
SESSION = "torchx"  # get_runner()'s session name: the middle part of every handle it makes
# a replica's output file under torchx's slurm scheduler
_REPLICA_FILE = re.compile(r"slurm-(?P<id>[0-9]+)-(?P<role>.+)-(?P<k>[0-9]+)\.(?P<ext>out|err)")

# torchx.specs.AppState names -> JobState. Names, not the enum, so records and tests need no torchx.
TORCHX_STATES: Mapping[str, JobState] = {
    "UNSUBMITTED": JobState.PENDING,
    "SUBMITTED": JobState.PENDING,
    "PENDING": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "SUCCEEDED": JobState.COMPLETED,
    "FAILED": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
    "UNKNOWN": JobState.UNKNOWN,
}


def state_from_torchx(name: str) -> JobState:
    """Map a torchx ``AppState`` name (``SUCCEEDED``) to a :class:`JobState`; else UNKNOWN."""
    return TORCHX_STATES.get(name.upper(), JobState.UNKNOWN)


# --- the runner, and the caller's signals -----------------------------------------------------


class _Stopped(BaseException):
    """SIGINT or SIGTERM came to the submitting process while its local app ran."""


def _torchx_signal() -> type[BaseException]:
    """What torchx's own SIGINT and SIGTERM handlers raise."""
    found: type[BaseException] = import_torchx("schedulers.local_scheduler").SignalException
    return found


@contextmanager
def _runner() -> Iterator[Any]:
    """A torchx ``Runner``, closed after use (closing kills the local apps it still runs), with
    the caller's SIGINT and SIGTERM handlers put back: torchx's ``LocalScheduler`` sets its own
    (raising ``SignalException``) in the whole process and never restores them, so Ctrl-C would
    raise torchx's exception, not ``KeyboardInterrupt``. That exception, raised while a runner
    is in use, comes out as ``KeyboardInterrupt`` too."""
    main = threading.current_thread() is threading.main_thread()
    saved = [(signum, signal.getsignal(signum)) for signum in HELD_SIGNALS] if main else []
    torchx_signal = _torchx_signal()
    runner = import_torchx("runner").get_runner()
    try:
        try:
            yield runner
        finally:
            try:
                runner.close()
            finally:
                for signum, handler in saved:
                    if handler is not None:  # None: not set from Python, nothing to put back
                        signal.signal(signum, handler)
    except torchx_signal as exc:  # raised by torchx's handler (its close too): Ctrl-C's
        raise KeyboardInterrupt from exc


class TorchxBackend:
    """The ``torchx`` backend: the spec's AppDef through torchx's runner.

    The request carries torchx's own dry-run info, and ``schedule`` hands exactly that to
    ``Runner.schedule`` (what ``Runner.run`` does in one go). slurm returns once sbatch has
    accepted the job; local_cwd once the app has ended (its record then says how).
    """

    via: Via = "torchx"

    def dry_run(self, spec: JobSpec, scheduler: str | None = None) -> Request:
        """torchx's dry run of the spec's AppDef. The run config (torchx ``cfg``) is the spec's
        SLURM options, and for local_cwd the spec's ``log_dir``, so the output files outlive
        the submitting process."""
        scheduler = scheduler or DEFAULT_SCHEDULER
        if scheduler not in SCHEDULERS:
            raise ConfigError(
                f"scheduler={scheduler!r} is not supported by ddpkit's torchx jobs",
                hint=f"use one of {', '.join(SCHEDULERS)}",
            )
        app, cfg = spec_to_appdef(spec, scheduler=scheduler), scheduler_cfg(spec, scheduler)
        if scheduler == "local_cwd":
            cfg["log_dir"] = spec.log_path
        with _runner() as runner:
            info = runner.dryrun(app, scheduler, cfg=cfg)
        head = f"# torchx dryrun: scheduler={scheduler} cfg={json.dumps(cfg, sort_keys=True)}"
        unused = _slurm_only(spec) if scheduler != "slurm" else []
        notes = (f"not used by {scheduler} (SLURM options): {', '.join(unused)}",) if unused else ()
        head += "".join(f"\n# {note}" for note in notes)
        text = f"{head}\n{info}\n"
        foreground = scheduler != "slurm"  # local_cwd: the app runs until it ends
        return Request(
            self.via, spec, text, scheduler, payload=info, notes=notes, foreground=foreground
        )

    def schedule(self, request: Request) -> JobRecord:
        info, spec = request.payload, request.spec
        script = str(info)  # before schedule(), which adds the script's path to the command
        with _runner() as runner:
            if request.scheduler == "slurm":
                return replace(_record(spec, runner.schedule(info)), script=script)
            # local_cwd: its app has ended when the runner closes; closing kills nothing alive
            return _run_local(runner, request, script)

    def status(self, job_id: str, record: JobRecord | None) -> JobStatus:
        """SLURM's own answer for slurm apps, the recorded one for local apps; torchx's
        failures become UNKNOWN with a hint, never an exception."""
        record = record or record_for(job_id)
        handle = record.handle or ""
        scheduler, app_id = split_handle(handle)
        if scheduler == "slurm":
            try:
                found = slurm.query_state(app_id)
            except DdpkitError as exc:  # no SLURM tools here: torchx may still know
                found = _unknown(str(exc))
            if found.state is not JobState.UNKNOWN:
                return found
            return _ask_torchx(handle, found.hint or "")
        if record.final_state is not None:
            state = state_from_torchx(record.final_state)
            return JobStatus(state, record.final_state, _local_exit_code(record), "torchx")
        return _ask_torchx(
            handle,
            f"{scheduler} apps live in the process that submitted them and no final state is "
            "recorded: that `ddpkit submit` is still running it, or was killed",
        )

    def cancel(self, job_id: str, record: JobRecord | None) -> None:
        """``scancel`` for slurm apps; a local app only its own submitter can stop."""
        record = record or record_for(job_id)
        scheduler, app_id = split_handle(record.handle or "")
        if scheduler == "slurm":  # not torchx's cancel: it asks the asserting describe first
            slurm.cancel(app_id)
        elif record.final_state is None:
            raise ConfigError(
                f"job={record.handle!r} runs in the process of the `ddpkit submit` that "
                "started it, which this one cannot reach",
                hint="stop it with Ctrl-C where it runs (torchx then cancels the app)",
            )
        # a local app that ended: nothing to do, as scancel leaves an ended job alone

    def sweep_status(self, job_id: str, record: JobRecord | None) -> list[SweepTask] | None:
        return None  # torchx has no job arrays: spec_to_appdef refuses a sweep

    def log_files(
        self, job_id: str, record: JobRecord | None, rank: int | None
    ) -> tuple[list[LogFile], str]:
        """The job's output files that exist (torchx's own files) and where they were looked for.

        Files come per replica (one replica per node, each running ``ddpkit run``, whose output
        lines start with ``[rankN]: ``). Replica k gets node k's ranks when the replicas'
        SLURM_NODEID number them (``ddpkit.launch.node_order``), else the rendezvous decides, so
        ``rank`` keeps that rank's lines of every replica's files.
        """
        record = record or record_for(job_id)
        scheduler, app_id = split_handle(record.handle or "")
        directory = Path(record.log_dir)
        replicas: list[tuple[int, str, Path]] = []  # (replica, label, path)
        batch: list[LogFile] = []
        if scheduler == "slurm":
            looked = f"{directory}/slurm-{app_id}{{,-<role>-<k>.out,-<role>-<k>.err}}"
            batch = [LogFile(p, "batch") for p in sorted(directory.glob(f"slurm-{app_id}.out"))]
            for path in directory.glob(f"slurm-{app_id}-*-*.*"):
                match = _REPLICA_FILE.fullmatch(path.name)
                if match is not None and match["id"] == app_id:
                    k = int(match["k"])
                    replicas.append((k, f"{match['role']} replica {k} std{match['ext']}", path))
        else:
            looked = f"{directory}/<role>/<k>/combined.log"
            for path in directory.glob("*/*/combined.log"):
                if path.parent.name.isascii() and path.parent.name.isdigit():
                    k = int(path.parent.name)
                    replicas.append((k, f"{path.parent.parent.name} replica {k}", path))
        replicas.sort(key=lambda item: (item[0], item[1]))
        if rank is None:
            return batch + [LogFile(path, label) for _, label, path in replicas], looked
        return [LogFile(path, label, rank) for _, label, path in replicas], looked


BACKEND = TorchxBackend()


def _slurm_only(spec: JobSpec) -> list[str]:
    """The spec's SLURM options that a scheduler other than slurm has no use for."""
    names = ["partition", "account", "qos", "constraint"]
    unused = [name for name in names if getattr(spec, name) is not None]
    return unused + [f"sbatch.{k}" for k in sorted(spec.sbatch) if spec.sbatch[k] is not False]


def _run_local(runner: Any, request: Request, script: str) -> JobRecord:
    """Start a local app and wait for it to end; its record with torchx's final state.

    SIGINT (Ctrl-C) or SIGTERM cancels it (``CANCELLED``): its processes are this one's
    children, which must not outlive it. torchx makes its local scheduler, and sets its own
    handlers, before anything starts (see :func:`_runner`). From the app's start until its
    record is saved the signal is held (:func:`~ddpkit.jobs.interrupts.held_stop_signals`):
    one raised between a replica's start and torchx's note of it would leave that replica
    running, in a session of its own, with nothing left to stop it."""
    main = threading.current_thread() is threading.main_thread()

    def handle_with(handler: Any) -> None:
        for signum in HELD_SIGNALS if main else ():
            signal.signal(signum, handler)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stopped(signum)

    runner.scheduler_run_opts(request.scheduler or DEFAULT_SCHEDULER)  # public: makes it
    stopped = (KeyboardInterrupt, _Stopped, _torchx_signal())
    try:
        with held_stop_signals():  # raised as the block ends, by torchx's handler
            handle: str = runner.schedule(request.payload)
            record = replace(_record(request.spec, handle), script=script)
            save_record(record)  # while it runs in the foreground, status finds it
        handle_with(stop)
        final = runner.wait(handle, wait_interval=0.2)
        # it ended: a signal from here on is ignored until the runner's close puts the caller's
        # handlers back (raised in the close, it was a traceback)
        handle_with(signal.SIG_IGN)
    except stopped:
        handle_with(signal.SIG_IGN)  # a second Ctrl-C does not cut the cancel short
        runner.cancel(handle)
        return replace(record, final_state="CANCELLED")
    return replace(record, final_state="UNKNOWN" if final is None else str(final.state.name))


def _record(spec: JobSpec, handle: str) -> JobRecord:
    scheduler, app_id = split_handle(handle)
    # slurm: srun's output files land in sbatch's working directory, where torchx ran it (the
    # replicas then cd to the workdir); local: <log_dir cfg>/<session>/<app id>/<role>/<k>/*.log
    local = os.path.join(spec.log_path, SESSION, app_id)
    log_dir = str(Path.cwd()) if scheduler == "slurm" else local
    run_id = submitted_run_id(spec.env, app_id if scheduler == "slurm" else None, os.environ)
    record = new_record(spec, app_id, "torchx", None, launch="torchx")
    return replace(record, log_dir=log_dir, run_id=run_id, handle=handle)


def record_for(handle: str) -> JobRecord:
    """A record for a handle ddpkit did not submit (``torchx run`` did): what can be guessed."""
    app_id = split_handle(handle)[1]
    cwd = str(Path.cwd())
    return JobRecord(app_id, "torchx", app_id, cwd, "torchx", 0, 0, cwd, handle=handle)


def _unknown(hint: str) -> JobStatus:
    return JobStatus(JobState.UNKNOWN, "", None, "none", hint=hint)


def _ask_torchx(handle: str, why: str) -> JobStatus:
    """torchx's status of ``handle`` mapped by TORCHX_STATES; any failure is UNKNOWN + hint."""
    try:
        with _runner() as runner:
            answer = runner.status(handle)
    except Exception as exc:  # torchx's own bugs included (AssertionError on CANCELLED by 0)
        return _unknown(
            f"{why}; torchx's status failed too: {type(exc).__name__}: {exc}".lstrip("; ")
        )
    if answer is None:
        return _unknown(f"{why}; torchx does not know {handle} either".lstrip("; "))
    name = str(answer.state.name)
    return JobStatus(state_from_torchx(name), name, None, "torchx")


def _local_exit_code(record: JobRecord) -> int | None:
    """The first non-zero replica exit code (else 0) from the SUCCESS file torchx leaves."""
    try:
        info = json.loads(Path(record.log_dir, "SUCCESS").read_text(encoding="utf-8"))
        codes = [r["exitcode"] for rs in info["roles"].values() for r in rs]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not all(isinstance(code, int) for code in codes):
        return None
    return next((code for code in codes if code != 0), 0)
