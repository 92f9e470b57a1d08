"""SLURM's command-line tools behind the one :class:`Runner` seam (torch-free, stdlib only).

    runner.py    the seam: ``runner(argv, stdin=, env=) -> CommandResult``; the real one runs
                 the tool with a timeout; every SLURM command of ddpkit goes through it
    states.py    JobState, the ONE table from SLURM's state strings to it, JobStatus
    query.py     job ids; one parser per tool's output; squeue -> sacct -> scontrol -> UNKNOWN
    arrays.py    every task of a job array at once
    commands.py  submit (sbatch), cancel (scancel), requeue (scontrol), the waiting loop
    config.py    ``scontrol show config``, asked and parsed in one place
    chains.py    job chains: the ids a job name stands for, why a job waits (its reason)

Nothing here imports torch or writes ``os.environ``; ``env=None`` means the caller's
environment. The names below are the ones the rest of ddpkit uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit._lazy import lazy_exports

# Lazy: ``python -m ddpkit.cluster.rendezvous.resv_ports`` (on every job's srun line) reads
# config.py alone, and the commands import only the tools they use.
_EXPORTS = {
    "jobs_named": "ddpkit.cluster.slurmtools.chains",
    "pending_reason": "ddpkit.cluster.slurmtools.chains",
    "reason_hint": "ddpkit.cluster.slurmtools.chains",
    "cancel": "ddpkit.cluster.slurmtools.commands",
    "poll_until_finished": "ddpkit.cluster.slurmtools.commands",
    "submit_script": "ddpkit.cluster.slurmtools.commands",
    "job_restarts": "ddpkit.cluster.slurmtools.query",
    "parse_job_id": "ddpkit.cluster.slurmtools.query",
    "query_state": "ddpkit.cluster.slurmtools.query",
    "CommandResult": "ddpkit.cluster.slurmtools.runner",
    "Runner": "ddpkit.cluster.slurmtools.runner",
    "SlurmError": "ddpkit.cluster.slurmtools.runner",
    "subprocess_runner": "ddpkit.cluster.slurmtools.runner",
    "SLURM_STATES": "ddpkit.cluster.slurmtools.states",
    "JobState": "ddpkit.cluster.slurmtools.states",
    "JobStatus": "ddpkit.cluster.slurmtools.states",
    "state_from_slurm": "ddpkit.cluster.slurmtools.states",
}

__all__ = [
    "SLURM_STATES",
    "CommandResult",
    "JobState",
    "JobStatus",
    "Runner",
    "SlurmError",
    "cancel",
    "job_restarts",
    "jobs_named",
    "parse_job_id",
    "pending_reason",
    "poll_until_finished",
    "query_state",
    "reason_hint",
    "state_from_slurm",
    "submit_script",
    "subprocess_runner",
]

if TYPE_CHECKING:
    from ddpkit.cluster.slurmtools.chains import jobs_named, pending_reason, reason_hint
    from ddpkit.cluster.slurmtools.commands import (
        cancel,
        poll_until_finished,
        submit_script,
    )
    from ddpkit.cluster.slurmtools.query import (
        job_restarts,
        parse_job_id,
        query_state,
    )
    from ddpkit.cluster.slurmtools.runner import (
        CommandResult,
        Runner,
        SlurmError,
        subprocess_runner,
    )
    from ddpkit.cluster.slurmtools.states import (
        SLURM_STATES,
        JobState,
        JobStatus,
        state_from_slurm,
    )

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
