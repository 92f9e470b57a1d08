"""A spec's ``health_check`` in the rendered sbatch script, run under bash: a stub ``srun``
runs the health step once per node (``SLURMD_NODENAME`` set) and records every other step; a
stub ``scontrol`` records and answers ``show job``. The check is hostile (quotes, ``$()``,
``;``): it must run as written on each node and inject nothing into the batch shell. The
real cluster: test_health_check_cluster.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.contract import HEALTH_MODULE, STOP_HOLD_MODULE
from ddpkit.errors import ConfigError
from ddpkit.jobs import render
from ddpkit.jobs.backends.submitit import executor_parameters
from ddpkit.jobs.backends.torchx_appdef import spec_to_appdef
from ddpkit.jobs.spec import JobSpec
from tests.fakes.slurm import FakeTools

# fails on the node named in $RECORD_DIR/bad (the step writes it), else in BAD_NODE, printing a
# hostile line; `touch` would leave pwned*
CHECK = (
    'bad="$(cat "$RECORD_DIR/bad" 2>/dev/null || echo "$BAD_NODE")"; '
    '[ "$SLURMD_NODENAME" != "$bad" ] || '
    '{ echo "it\'s bad; $(echo sub) \\$(touch pwned1) `echo tick`"; exit 1; } # ; touch pwned2'
)
SRUN = """#!/bin/bash
# the health step: run its command once per node of $FAKE_NODES; any other step: recorded
if printf '%s\\n' "$@" | grep -qx {module}; then
  while [ "${{1#--}}" != "$1" ]; do shift; done
  for node in $FAKE_NODES; do SLURMD_NODENAME="$node" "$@"; done
  exit 0
fi
mkdir -p "$RECORD_DIR"; printf '%s\\0' "$@" > "$RECORD_DIR/srun.$$"
# the job's step: on request, a node goes bad meanwhile, and the step fails
if [ -n "$BAD_AFTER_STEP" ]; then echo "$BAD_AFTER_STEP" > "$RECORD_DIR/bad"; fi
exit "${{FAKE_STEP_EXIT:-0}}"
"""
SCONTROL = """#!/bin/bash
printf '%s\\0' "$@" >> "$RECORD_DIR/scontrol.calls"; printf '\\n' >> "$RECORD_DIR/scontrol.calls"
if [ "$1" = show ]; then echo "JobId=$SLURM_JOB_ID JobName=x ExcNodeList=(null) Partition=debug"; fi
exit 0
"""


def health_spec(tmp_path: Path, **fields: Any) -> JobSpec:
    return JobSpec.model_validate({
        "name": "hc", "command": ["app.py"], "python": sys.executable, "nodes": 2,
        "workdir": str(tmp_path / "work it's $(touch pwned3)"), "log_dir": "logs",
        "health_check": CHECK, "max_excluded_nodes": 1, "health_check_timeout_s": 30,
        "signal": None,
    } | fields)  # fmt: skip


def run(
    job: JobSpec, tmp_path: Path, bad: str, **more: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    tools = FakeTools(tmp_path / "bin")
    tools.install("srun", SRUN.format(module=shlex.quote(HEALTH_MODULE)))
    tools.install("scontrol", SCONTROL)
    tools.install("sinfo", "#!/bin/sh\nprintf 'n1 idle\\nn2 idle\\nn3 idle\\nn4 idle\\n'\n")
    Path(job.workdir).mkdir(parents=True, exist_ok=True)
    records = tmp_path / "records"
    records.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(render.render_sbatch(job))
    env = {
        "PATH": tools.path(), "HOME": str(tmp_path), "LANG": "C.UTF-8",
        "RECORD_DIR": str(records), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[3-4]",
        "SLURM_JOB_PARTITION": "debug", "FAKE_NODES": "n3 n4", "BAD_NODE": bad,
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **more,
    }  # fmt: skip
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert not list(tmp_path.rglob("pwned*")), done.stderr
    return done, records


def scontrol_calls(records: Path) -> list[list[str]]:
    path = records / "scontrol.calls"
    if not path.exists():
        return []
    return [line.split("\0")[:-1] for line in path.read_text().splitlines() if line]


def test_healthy_nodes_let_the_job_start(tmp_path: Path) -> None:
    done, records = run(health_spec(tmp_path), tmp_path, bad="none")
    assert done.returncode == 0, done.stderr
    assert "ddpkit: health check passed on n3, n4 (attempt 0)" in done.stderr
    assert [p.name.split(".")[0] for p in records.glob("srun.*")] == ["srun"]  # the job's step
    assert scontrol_calls(records) == [["show", "config"]]  # srun's port probe only


def test_a_failing_node_is_excluded_and_the_job_requeued_before_its_step(tmp_path: Path) -> None:
    done, records = run(health_spec(tmp_path), tmp_path, bad="n4")
    assert done.returncode == 0, done.stderr  # requeued: the batch shell ends quietly
    said = "it's bad; sub $(touch pwned1) tick"  # the check ran as written, on n4 only
    assert f"ddpkit health check [n4]: {said}" in done.stderr
    assert "[n3]" not in done.stderr
    assert (
        f"ddpkit: excluding node n4 (health check failed: exit code 1: {said}); "
        "requeue attempt 1, excluded: n4 (1 of max 1)"
    ) in done.stderr
    assert scontrol_calls(records) == [
        ["show", "job", "--oneliner", "4242"],
        ["requeue", "4242"],
        ["update", "JobId=4242", "ExcNodeList=n4"],
    ]
    assert not list(records.glob("srun.*")), "the job's step ran on a blamed node"


def test_past_the_cap_the_job_fails_before_its_step(tmp_path: Path) -> None:
    done, records = run(health_spec(tmp_path, max_excluded_nodes=0), tmp_path, bad="n3")
    assert done.returncode == 1, done.stderr
    assert "not excluding n3: max_excluded_nodes=0 would be exceeded" in done.stderr
    assert ["requeue", "4242"] not in scontrol_calls(records)
    assert not list(records.glob("srun.*"))


def test_the_health_step_comes_before_the_jobs_step_with_the_signal_protocol(
    tmp_path: Path,
) -> None:
    text = render.render_sbatch(health_spec(tmp_path, signal="USR2"))
    assert text.index(HEALTH_MODULE) < text.index(STOP_HOLD_MODULE + " ")
    assert text.index("trap ") < text.index(HEALTH_MODULE)


def test_no_health_check_no_health_step(tmp_path: Path) -> None:
    assert HEALTH_MODULE not in render.render_sbatch(health_spec(tmp_path, health_check=None))


def test_submitit_and_torchx_refuse_a_health_check(tmp_path: Path) -> None:
    job = health_spec(tmp_path)
    with pytest.raises(ConfigError, match=r"health_check=.* runs only in ddpkit's sbatch"):
        executor_parameters(job)
    with pytest.raises(ConfigError, match=r"health_check=.* runs only in ddpkit's sbatch"):
        spec_to_appdef(job)


@pytest.mark.parametrize("signal", ["USR2", None])
def test_a_step_that_fails_on_a_node_gone_bad_is_requeued_without_it(
    tmp_path: Path, signal: str | None
) -> None:
    job = health_spec(tmp_path, signal=signal)
    done, records = run(job, tmp_path, bad="none", BAD_AFTER_STEP="n3", FAKE_STEP_EXIT="3")
    assert done.returncode == 0, done.stderr
    assert "ddpkit: health check passed on n3, n4 (attempt 0)" in done.stderr
    assert (
        "ddpkit: excluding node n3 (health check failed after the job's step exited 3: exit "
        "code 1: it's bad; sub $(touch pwned1) tick); requeue attempt 1, excluded: n3 (1 of max 1)"
    ) in done.stderr
    assert scontrol_calls(records)[-2:] == [
        ["requeue", "4242"],
        ["update", "JobId=4242", "ExcNodeList=n3"],
    ]


@pytest.mark.parametrize("signal", ["USR2", None])
def test_a_step_that_fails_on_healthy_nodes_ends_with_its_code(
    tmp_path: Path, signal: str | None
) -> None:
    job = health_spec(tmp_path, signal=signal)
    done, records = run(job, tmp_path, bad="none", FAKE_STEP_EXIT="7")
    assert done.returncode == 7, done.stderr
    assert "ddpkit: the job's step exited 7; no node failed its health check after it" in (
        done.stderr
    )
    assert ["requeue", "4242"] not in scontrol_calls(records)
