"""Every ``DDPKIT_*`` name and its default, the user-facing variable table, and the module
paths job scripts run: the contract between ddpkit's parts, and with its users.

Three kinds of variables, one table (:data:`ENVIRONMENT`, in the reference's order; the docs
page docs/reference/environment.md is generated from it):

* knobs a user sets (``set_by="you"``): timeouts, progress, logging, ``DDPKIT_HOME``;
* the job-script contract (:data:`JOB_SCRIPT`): what every way ddpkit starts a job (the sbatch
  templates, submitit, torchx) hands the running job, computed from the spec by
  :func:`ddpkit.jobs.exports.exports`; a spec's ``env`` may not set them (:data:`RESERVED_ENV`);
* the sweep's: ``DDPKIT_SWEEP_TASK``, ``DDPKIT_SWEEP_RUN`` and one ``DDPKIT_SWEEP_<NAME>`` per
  parameter (:data:`SWEEP_VAR_PREFIX`).

A job script already submitted calls ddpkit by the module paths below (``python -m ...``): the
templates (through the render context), the renderer and the torchx conversion take them from
here, so that a move changes one line.

Standard library only (and cheap: ``ddpkit run``'s first line imports it), and no other
ddpkit module: every layer imports it.
"""

from __future__ import annotations

from typing import Final, NamedTuple

# ---- knobs ---------------------------------------------------------------------------------
CONNECT_TIMEOUT_VAR: Final = "DDPKIT_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_S: Final = 60.0
# What a default start-up bound (the connect bound, `ddpkit run`'s c10d read timeout) grows by
# per rank of the job after the first: a store serves its clients one by one, and torch's own
# figures (96K ranks ready in ~100 s on its libuv store, ~1 ms a rank) make 10 ms a rank a 10x
# margin. A bound the user sets is used as given.
BOUND_PER_RANK_S: Final = 0.01
COLLECTIVE_TIMEOUT_VAR: Final = "DDPKIT_COLLECTIVE_TIMEOUT"  # default: torch's own
PEER_TIMEOUT_VAR: Final = "DDPKIT_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT_S: Final = 60.0
HANG_TIMEOUT_VAR: Final = "DDPKIT_HANG_TIMEOUT"
DEFAULT_HANG_TIMEOUT_S: Final = 180.0
HANG_FIRST_TIMEOUT_VAR: Final = "DDPKIT_HANG_FIRST_TIMEOUT"
DEFAULT_HANG_FIRST_TIMEOUT_S: Final = 900.0
HANG_ACTION_VAR: Final = "DDPKIT_HANG_ACTION"
HANG_ACTIONS: Final = ("report", "end")  # the first is the default
STRAGGLER_INTERVAL_VAR: Final = "DDPKIT_STRAGGLER_INTERVAL"
DEFAULT_STRAGGLER_INTERVAL_S: Final = 300.0
# the hang watchdog's report, in the attempt's log folder of `ddpkit run`: the launcher quotes it
HANG_REPORT_FILE: Final = "ddpkit-hang-report.txt"
PROGRESS_VAR: Final = "DDPKIT_PROGRESS"
LOG_ALL_RANKS_VAR: Final = "DDPKIT_LOG_ALL_RANKS"
HOME_VAR: Final = "DDPKIT_HOME"
DEFAULT_HOME: Final = "~/.cache/ddpkit"
LAUNCH_TOKEN_VAR: Final = "DDPKIT_LAUNCH_TOKEN"  # set by `ddpkit run` for its workers
# yours to set; else `ddpkit run` sets it for its workers (ddpkit.cluster.runid says from what)
RUN_ID_VAR: Final = "DDPKIT_RUN_ID"
RUN_ID_MAX_CHARS: Final = 128  # a W&B run id, a file name, a log line: short and plain

# ---- the job-script contract ---------------------------------------------------------------
EXPECTED_WORLD_SIZE_VAR: Final = "DDPKIT_EXPECTED_WORLD_SIZE"
JOB_LAUNCH_VAR: Final = "DDPKIT_JOB_LAUNCH"
HOST_TEMPLATE_VAR: Final = "DDPKIT_HOST_TEMPLATE"
SIGNAL_VAR: Final = "DDPKIT_SIGNAL"
# NCCL and some MPI stacks use USR1 for themselves; the signals it may name: ddpkit.cluster.stop
DEFAULT_SIGNAL: Final = "USR2"
MAX_REQUEUES_VAR: Final = "DDPKIT_MAX_REQUEUES"
DEFAULT_MAX_REQUEUES: Final = 10
LATCH_DIR_VAR: Final = "DDPKIT_LATCH_DIR"
LOG_DIR_VAR: Final = "DDPKIT_LOG_DIR"
# not ddpkit's: which signal submitit's job side binds (its own handler, replaced by ddpkit's)
SUBMITIT_SIGNAL_VAR: Final = "SUBMITIT_PREEMPT_SIGNAL"

# ---- the sweep's ---------------------------------------------------------------------------
SWEEP_VAR_PREFIX: Final = "DDPKIT_SWEEP_"
SWEEP_TASK_VAR: Final = SWEEP_VAR_PREFIX + "TASK"
SWEEP_RUN_VAR: Final = SWEEP_VAR_PREFIX + "RUN"

# ---- what job scripts run (python -m ...) --------------------------------------------------
RESV_PORTS_MODULE: Final = (
    "ddpkit.cluster.rendezvous.resv_ports"  # srun's --resv-ports or nothing (older scripts)
)
ENDPOINT_MODULE: Final = "ddpkit.cluster.rendezvous.endpoint"  # prints the c10d endpoint host:port
CLI_MODULE: Final = "ddpkit"  # `python -m ddpkit run ...` on each node (launch: torchrun)
RUN_COMMAND: Final = "run"
STOP_HOLD_MODULE: Final = "ddpkit.cluster.stop.hold"  # each srun task's stop-signal holder
HEALTH_MODULE: Final = "ddpkit.cluster.stop.health"  # a spec's health_check, on each node
EXCLUDE_MODULE: Final = "ddpkit.cluster.stop.exclude"  # blames, excludes and requeues bad nodes
# submitit tasks unpickle RunCommand from it (jobs/ names it by this path: launch/ is above)
SUBMITIT_TASK_MODULE: Final = "ddpkit.launch.submitit_task"


class EnvVar(NamedTuple):
    """One variable as the reference shows it (markdown texts); a NamedTuple, not a dataclass:
    ``ddpkit run``'s first line imports this module, before it can hold the stop signal."""

    name: str  # DDPKIT_SWEEP_<NAME> stands for a family
    set_by: str  # "you" (a knob), "job script", "sweep", or "`ddpkit run`"
    default: str  # "" when there is none
    meaning: str  # one paragraph; "{signals}" is the list of stop signals (ddpkit.cluster.stop)
    instead: str = ""  # job-script and sweep variables: what a spec sets instead of env


ENVIRONMENT: tuple[EnvVar, ...] = (
    EnvVar(
        CONNECT_TIMEOUT_VAR,
        "you",
        f"{DEFAULT_CONNECT_TIMEOUT_S:g} s + {BOUND_PER_RANK_S * 1000:g} ms a rank after the first",
        "Seconds a rank other than 0 waits for the master to accept connections before "
        "`ddpkit.init()` fails naming the address, port and launcher. Unset, the bound grows "
        "with the job (4,096 ranks: 101 s); a value set here is used as given. "
        "`init(connect_timeout_s=)` wins over it.",
    ),
    EnvVar(
        COLLECTIVE_TIMEOUT_VAR,
        "you",
        "torch's (10-30 min by backend)",
        "The collective timeout in seconds: it bounds a rank that hangs while alive. Keep it "
        "above your program's longest wait (ranks at a barrier while rank 0 prepares data). "
        "`init(timeout_s=)` wins over it.",
    ),
    EnvVar(
        PEER_TIMEOUT_VAR,
        "you",
        f"{DEFAULT_PEER_TIMEOUT_S:g} s",
        "The watchdog's bound in seconds: when a peer has exited, died or frozen and this "
        "rank stays blocked that long, it ends with a line naming the peer. `0` or `off` "
        "turns the watchdog off; `init(peer_timeout_s=)` wins over it.",
    ),
    EnvVar(
        HANG_TIMEOUT_VAR,
        "you",
        f"{DEFAULT_HANG_TIMEOUT_S:g} s",
        "The hang watchdog's per-collective bound in seconds, once the job is past its first "
        "step: a rank in one collective that long (every rank alive) gathers every rank's "
        "stack and last collectives and names the stuck rank in one report (see "
        f"`{HANG_ACTION_VAR}`). Grows with the world size past 64 ranks (x log2(world)/6). "
        "`0` or `off` turns it off; `init(hang_timeout_s=)` wins over it.",
        "set hang_timeout_s instead",
    ),
    EnvVar(
        HANG_ACTION_VAR,
        "you",
        HANG_ACTIONS[0],
        "What the hang watchdog does once its report is out. `report`: rank 0 prints it, it "
        "is kept in the log folder, and the job goes on (a rank may be slow, not stuck: "
        "torch's collective timeout ends a job that never resumes, as without ddpkit). `end`: "
        "every rank ends with code 1 at the report, which saves the rest of a hung job's "
        "allocation.",
    ),
    EnvVar(
        STRAGGLER_INTERVAL_VAR,
        "you",
        f"{DEFAULT_STRAGGLER_INTERVAL_S:g} s",
        "The straggler report's period in seconds: each rank shares its data-wait and compute "
        "times per step; when the same rank is the slowest by more than a quarter of the step "
        "for two periods in a row, rank 0 prints which, by how much and the likely cause. "
        "`0` or `off` turns it off.",
    ),
    EnvVar(
        HANG_FIRST_TIMEOUT_VAR,
        "you",
        f"{DEFAULT_HANG_FIRST_TIMEOUT_S:g} s",
        "The hang watchdog's bound before the job's first step (until a collective's call "
        "site comes round again): generous, so that ranks may wait while rank 0 prepares "
        "data. Never below the other bound; `init(hang_first_timeout_s=)` wins over it.",
        "set hang_first_timeout_s instead",
    ),
    EnvVar(
        PROGRESS_VAR,
        "you",
        "a bar only on a terminal",
        "`0` silences `ddpkit.progress`; `1` draws it on the main rank even into a file (a "
        "line every 10 s). Also true/false, yes/no, on/off.",
    ),
    EnvVar(
        LOG_ALL_RANKS_VAR,
        "you",
        "main rank only",
        "`1`: `ddpkit.get_logger()` logs on every rank at DEBUG, each line prefixed with its rank.",
    ),
    EnvVar(
        HOME_VAR,
        "you",
        f"`{DEFAULT_HOME}`",
        "Where `ddpkit submit` keeps its job records (`$DDPKIT_HOME/jobs`), and the third "
        "place a profile name is looked up (`$DDPKIT_HOME/profiles`; unset: "
        "`${XDG_CONFIG_HOME:-~/.config}/ddpkit/profiles`).",
    ),
    EnvVar(
        LAUNCH_TOKEN_VAR,
        "`ddpkit run`",
        "",
        "A fresh value per launch in the environment of its workers, and so of every process "
        "they start. When the launcher dies without having ended normally (`kill -9`, the "
        "OOM killer), its sweeper kills every process that carries it (Linux). Not yours to "
        "set.",
    ),
    EnvVar(
        RUN_ID_VAR,
        "you, else `ddpkit run`",
        "the SLURM job (`slurm-<job id>`, `slurm-<array id>_<task>`), else the launch",
        "The run's identity, the same on every rank and in every attempt of the run (a "
        "requeue, a `--max-restarts` restart): `ctx.run_id`, stored in each checkpoint, "
        "shown by `ddpkit status`; pass it to a tracker to resume one run per requeue (see "
        f"[tracking](../guide/tracking.md)). At most {RUN_ID_MAX_CHARS} characters: letters, "
        "digits, `.`, `_`, `-`, starting with a letter or digit. Without a SLURM job, `ddpkit "
        "run` sets it for its workers (the rendezvous id, else a fresh one per launch).",
    ),
    EnvVar(
        EXPECTED_WORLD_SIZE_VAR,
        "job script",
        "",
        "The job's number of processes. Detection checks it: a process that finds itself a world "
        "of one in a job of several (Python started without `srun`) fails with a hint instead of "
        "training alone.",
        "the job script sets it from nodes x procs_per_node (nodes: MIN-MAX: SLURM_JOB_NUM_NODES "
        "x procs_per_node, at run time)",
    ),
    EnvVar(
        HOST_TEMPLATE_VAR,
        "job script",
        "",
        "How to name a node on the fast network, e.g. `{host}-ib`: the master address (and a "
        "`launch: torchrun` job's c10d endpoint) is the first node's name through it.",
        "set host_template instead",
    ),
    EnvVar(
        JOB_LAUNCH_VAR,
        "job script",
        "",
        "`srun` or `torchrun`: how the job starts its processes, so that detection can tell a "
        "torchrun started inside each of several srun tasks (duplicate ranks) from a right layout.",
        "the job script sets it from launch",
    ),
    EnvVar(
        SIGNAL_VAR,
        "job script",
        f"`{DEFAULT_SIGNAL}`",
        "The stop signal `ddpkit.init()` latches and `preemption_guard()` watches. Accepted: "
        "{signals} (a spec's `signal:` takes {job_signals}).",
        "set signal instead",
    ),
    EnvVar(
        MAX_REQUEUES_VAR,
        "job script",
        f"{DEFAULT_MAX_REQUEUES}",
        "The requeue cap: `requeue_and_exit()` requeues only while `SLURM_RESTART_COUNT` is "
        "below it, else every rank exits 75.",
        "set max_requeues instead",
    ),
    EnvVar(
        LOG_DIR_VAR,
        "job script",
        "",
        "The job's log folder (the spec's `log_dir`, absolute): the hang watchdog writes its "
        "report there as `ddpkit-hang-report-<SLURM job id>.txt`.",
        "set log_dir instead",
    ),
    EnvVar(
        LATCH_DIR_VAR,
        "job script",
        "",
        "A fresh folder in `log_dir` where each process marks that it has latched the stop "
        "signal; the batch shell passes a held signal on once every process has. Every node must "
        "see the same folder.",
        "the batch script makes it for the stop signal's hold",
    ),
    EnvVar(
        SWEEP_TASK_VAR,
        "sweep",
        "",
        "A sweep run's array index (0, 1, ...).",
        "the batch script sets it from SLURM_ARRAY_TASK_ID",
    ),
    EnvVar(
        SWEEP_RUN_VAR,
        "sweep",
        "",
        "A sweep run's name, e.g. `lr=0.1,seed=2`: use it to name its folders.",
        "the batch script sets it from the task's values",
    ),
    EnvVar(
        SWEEP_VAR_PREFIX + "<NAME>",
        "sweep",
        "",
        "Each sweep parameter's value for this run, e.g. `DDPKIT_SWEEP_LR=0.1` for `lr`. "
        "A spec's `env` may not set a name with this prefix.",
    ),
)

# The variables a job script hands to the running job (in the table's order).
JOB_SCRIPT: tuple[EnvVar, ...] = tuple(v for v in ENVIRONMENT if v.instead)

# Set by the job script itself; a spec value would silently fight it.
RESERVED_ENV: dict[str, str] = {variable.name: variable.instead for variable in JOB_SCRIPT}
_SWEEP_HINT = "declare the parameter under sweep: instead; every rank gets DDPKIT_SWEEP_<NAME>"


def reserved_env_hint(key: str) -> str | None:
    """Why a spec's ``env`` may not set ``key`` (the contract's, or the sweep's prefix), or None."""
    if key in RESERVED_ENV:
        return RESERVED_ENV[key]
    return _SWEEP_HINT if key.startswith(SWEEP_VAR_PREFIX) else None
