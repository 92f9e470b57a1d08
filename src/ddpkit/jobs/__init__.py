"""Jobs on a SLURM cluster: describe once (YAML spec + site profile), plan, submit, follow.

    spec = ddpkit.jobs.load("job.yaml", ["nodes=2"])   # --set > spec > profile > defaults
    print(ddpkit.jobs.plan(spec))                          # resolved spec + rank layout
    print(ddpkit.jobs.dry_run(spec))                       # exactly the script sbatch would get
    job = ddpkit.jobs.submit(spec, via="sbatch")           # or via="submitit"
    ddpkit.jobs.status(job.job_id); ddpkit.jobs.read_logs(job.job_id, rank=1)
    ddpkit.jobs.cancel(job.job_id)

Everything the ``ddpkit plan|submit|status|logs|cancel`` commands do, as functions. Names are
imported lazily: pydantic, Jinja2 and submitit load only when a function that needs them runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "JobSpec": "ddpkit.jobs.spec",
    "ClusterProfile": "ddpkit.jobs.spec",
    "load_spec": "ddpkit.jobs.load",
    "load_profile": "ddpkit.jobs.load",
    "rank_layout": "ddpkit.jobs.layout",
    "format_plan": "ddpkit.jobs.layout",
    "render_sbatch": "ddpkit.jobs.render",
    "JobState": "ddpkit.cluster.slurmtools",
    "JobStatus": "ddpkit.cluster.slurmtools",
    "JobRecord": "ddpkit.jobs.records",
    "load": "ddpkit.jobs.api",
    "plan": "ddpkit.jobs.api",
    "dry_run": "ddpkit.jobs.api",
    "submit": "ddpkit.jobs.api",
    "submit_function": "ddpkit.jobs.api",
    "map_function": "ddpkit.jobs.api",
    "sweep_status": "ddpkit.jobs.api",
    "status": "ddpkit.jobs.api",
    "run_of": "ddpkit.jobs.api",
    "RunOfJob": "ddpkit.jobs.api",
    "cancel": "ddpkit.jobs.api",
    "wait": "ddpkit.jobs.api",
    "log_files": "ddpkit.jobs.api",
    "read_logs": "ddpkit.jobs.api",
    "follow_logs": "ddpkit.jobs.api",
    "JobLogs": "ddpkit.jobs.logs",
    "LogFile": "ddpkit.jobs.logs",
}

__all__ = [
    "ClusterProfile",
    "JobLogs",
    "JobRecord",
    "JobSpec",
    "JobState",
    "JobStatus",
    "LogFile",
    "RunOfJob",
    "cancel",
    "dry_run",
    "follow_logs",
    "format_plan",
    "load",
    "load_profile",
    "load_spec",
    "log_files",
    "map_function",
    "plan",
    "rank_layout",
    "read_logs",
    "render_sbatch",
    "run_of",
    "status",
    "submit",
    "submit_function",
    "sweep_status",
    "wait",
]

if TYPE_CHECKING:
    from ddpkit.cluster.slurmtools import JobState, JobStatus
    from ddpkit.jobs.api import (
        RunOfJob,
        cancel,
        dry_run,
        follow_logs,
        load,
        log_files,
        map_function,
        plan,
        read_logs,
        run_of,
        status,
        submit,
        submit_function,
        sweep_status,
        wait,
    )
    from ddpkit.jobs.layout import format_plan, rank_layout
    from ddpkit.jobs.load import load_profile, load_spec
    from ddpkit.jobs.logs import JobLogs, LogFile
    from ddpkit.jobs.records import JobRecord
    from ddpkit.jobs.render import render_sbatch
    from ddpkit.jobs.spec import ClusterProfile, JobSpec


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
