"""Sweeps through submitit on the real SLURM cluster: the spec's command and a Python function.

One module fixture submits both at once, then waits for every task:

* ``ddpkit submit job.yaml --via submitit --sweep a=1,2,<hostile>``: one array of three 1-node
  x 1-process runs of tests/scripts/sweep_report.py, which prints its arguments, its
  ``DDPKIT_SWEEP_*`` variables and the rank record ddpkit detects. The third value (quotes,
  ``$(...)``, backticks, ``*``, spaces) must reach the script as it is: no shell in between.
* ``ddpkit.jobs.map_function(report, spec=spec)`` over a 2-run zip sweep: ``report`` (from
  the same file, importable on the nodes through PYTHONPATH) returns its keyword values and
  its rank record.

The sbatch path's own cluster test (preemption, cancel of one task) is test_sweep_cluster.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = [pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
PAYLOAD = SCRIPTS / "sweep_report.py"
TIMEOUT_S = 120
HOSTILE = 'it\'s "dq"; $(touch pwned1) `touch pwned2` * 100% $HOME'
VALUES = ["1", "2", HOSTILE]
# run names: every character outside [A-Za-z0-9._+=,-] becomes "_" (docs/guide/sweeps.md)
RUNS = ["a=1", "a=2", "a=it_s__dq_____touch_pwned1___touch_pwned2____100___HOME"]
FN_VALUES = [{"lr": "0.5", "seed": "1"}, {"lr": "0.25", "seed": "2"}]


@dataclass
class Sweeps:
    workdir: Path
    env: dict[str, str]
    job: str  # the command's array, submitted with `ddpkit submit --via submitit`
    solo: str  # a one-run sweep of the same spec: submitit makes it a plain job
    states: dict[str, str]  # scontrol's final state of each task of both arrays
    # map_function's submitit.Job objects, one per run (their repr would ask sacct)
    fn_jobs: list[Any] = field(repr=False)
    fn_array: str

    def ddpkit(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ddpkit", *args],
            cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip

    def task_log(self, task: int) -> Path:
        """submitit's output file of the command array's task (its only rank)."""
        return self.workdir / "logs" / f"{self.job}_{task}_0_log.out"


def _report(path: Path) -> dict[str, Any]:
    text = path.read_text(errors="replace") if path.exists() else ""
    found = [json.loads(line) for line in text.splitlines() if line.startswith('{"argv"')]
    assert len(found) == 1, f"{path}: {text}"
    return found[0]


@pytest.fixture(scope="module")
def sweeps(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Sweeps]:
    slurm = SlurmCluster(slurm_cluster.env, slurm_cluster.info)
    workdir = tmp_path_factory.mktemp("subsweep")
    home = workdir / "home"
    pythonpath = os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))
    env = {**slurm.env, "DDPKIT_HOME": str(home), "PYTHONPATH": pythonpath}
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_JOB", "DDPKIT_SWEEP"))}
    common = (
        f"partition: debug\nnodes: 1\nprocs_per_node: 1\ncpus_per_task: 1\ntime_min: 5\n"
        f"workdir: {workdir}\n"
    )
    (workdir / "job.yaml").write_text(
        f"name: subsweep\n{common}log_dir: logs\n"
        f"command: {PAYLOAD} --a {{a}} pre{{a}}post --task {{sweep_task}} --run {{sweep_run}}\n"
    )
    (workdir / "fn.yaml").write_text(
        f"name: subsweep-fn\n{common}log_dir: fn-logs\ncommand: unused.py\n"
        "sweep:\n  mode: zip\n  params:\n    lr: ['0.5', '0.25']\n    seed: [1, 2]\n"
    )
    # the command's sweeps from the CLI, as users submit them, while this process maps the function
    submit = [sys.executable, "-m", "ddpkit", "submit", "job.yaml", "--via", "submitit"]
    clis = [
        subprocess.Popen(
            [*submit, "--sweep", values],
            cwd=workdir,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for values in ("a=" + ",".join(VALUES), "a=solo")
    ]
    try:
        with pytest.MonkeyPatch.context() as mp:
            # submitit's sbatch runs with this process's environment, which the job inherits
            for key in ("SLURM_CONF", "DDPKIT_HOME", "PYTHONPATH"):
                mp.setenv(key, env[key])
            mp.syspath_prepend(str(SCRIPTS))
            import sweep_report

            from ddpkit.jobs import api, map_function

            fn_jobs = map_function(sweep_report.report, spec=api.load(workdir / "fn.yaml"))
        fn_array = slurm.track(str(fn_jobs[0].job_id).partition("_")[0])
        job, solo = _job_ids(slurm, clis)
        tasks = [f"{job}_{i}" for i in range(len(VALUES))]
        tasks += [*(f"{fn_array}_{i}" for i in range(len(FN_VALUES))), solo]
        states = {task: slurm.wait(task, timeout_s=TIMEOUT_S, states=FINISHED) for task in tasks}
        yield Sweeps(workdir, env, job, solo, states, fn_jobs, fn_array)
    finally:
        for cli in clis:
            if cli.poll() is None:
                cli.kill()
                cli.communicate()
        slurm.cancel_tracked()


def _job_ids(slurm: SlurmCluster, clis: list[subprocess.Popen[str]]) -> list[str]:
    """The job id each `ddpkit submit` printed (each tracked before any is judged)."""
    outputs = [cli.communicate(timeout=60) for cli in clis]
    for cli, (out, _) in zip(clis, outputs, strict=True):
        if cli.returncode == 0 and out.strip().isdigit():
            slurm.track(out.strip())
    for cli, (out, err) in zip(clis, outputs, strict=True):
        assert cli.returncode == 0 and re.fullmatch(r"\d+\n", out), err
    return [out.strip() for out, _ in outputs]


def test_every_task_of_the_command_sees_its_own_value_as_argument_and_variable(
    sweeps: Sweeps,
) -> None:
    for task, (value, run) in enumerate(zip(VALUES, RUNS, strict=True)):
        where = f"task {task}: {sweeps.task_log(task).read_text(errors='replace')[-3000:]}"
        assert sweeps.states[f"{sweeps.job}_{task}"] == "COMPLETED", where
        report = _report(sweeps.task_log(task))
        assert report["argv"] == [
            "--a", value, f"pre{value}post", "--task", str(task), "--run", run
        ], where  # fmt: skip
        assert report["sweep"] == {
            "DDPKIT_SWEEP_TASK": str(task),
            "DDPKIT_SWEEP_RUN": run,
            "DDPKIT_SWEEP_A": value,
        }, where
        assert (report["rank"], report["world_size"], report["launcher"]) == (0, 1, "submitit")
    # the hostile value was never run by a shell, anywhere
    assert not list(sweeps.workdir.rglob("pwned*")), list(sweeps.workdir.rglob("pwned*"))


def test_status_is_one_table_of_runs(sweeps: Sweeps) -> None:
    done = sweeps.ddpkit("status", sweeps.job)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(VALUES) + 2, done.stdout
    assert lines[0].split() == ["task", "state", "attempt", "run", "id", "run"], done.stdout
    for task, run in enumerate(RUNS):
        job = f"{sweeps.job}_{task}"  # each task its own run id, at attempt 0
        assert re.fullmatch(
            rf"{job}\s+COMPLETED\b.*\s0\s+slurm-{job}\s+{re.escape(run)}", lines[task + 1]
        ), done.stdout
    assert lines[-1] == f"# {len(VALUES)} runs: {len(VALUES)} COMPLETED", done.stdout
    one = sweeps.ddpkit("status", f"{sweeps.job}_1")
    assert one.returncode == 0 and one.stdout.startswith("COMPLETED"), one.stdout + one.stderr


def test_logs_of_one_task_are_that_tasks_output(sweeps: Sweeps) -> None:
    done = sweeps.ddpkit("logs", f"{sweeps.job}_1")
    assert done.returncode == 0, done.stderr
    own = sweeps.task_log(1)
    assert f"==> {own} <==" in done.stdout, done.stdout
    assert own.read_text() in done.stdout and '"DDPKIT_SWEEP_A": "2"' in done.stdout
    for other in (0, 2):
        assert str(sweeps.task_log(other)) not in done.stdout, done.stdout
    rank = sweeps.ddpkit("logs", f"{sweeps.job}_2", "--rank", "0")
    assert rank.returncode == 0 and rank.stdout == sweeps.task_log(2).read_text(), rank.stderr
    every = sweeps.ddpkit("logs", sweeps.job)  # the array: every task's file, in task order
    assert every.returncode == 0, every.stderr
    shown = re.findall(r"^==> (.*) <==$", every.stdout, re.MULTILINE)
    assert shown == [str(sweeps.task_log(task)) for task in range(len(VALUES))], every.stdout


def test_map_function_returns_each_runs_values_and_rank(
    sweeps: Sweeps, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", sweeps.env["SLURM_CONF"])  # submitit may ask sacct
    monkeypatch.setenv("DDPKIT_HOME", sweeps.env["DDPKIT_HOME"])
    states = [sweeps.states[f"{sweeps.fn_array}_{i}"] for i in range(len(FN_VALUES))]
    assert states == ["COMPLETED"] * len(FN_VALUES), states
    expected = [
        {"values": values, "array_task": str(task), "rank": 0, "world_size": 1,
         "launcher": "submitit"}
        for task, values in enumerate(FN_VALUES)
    ]  # fmt: skip
    assert [job.result() for job in sweeps.fn_jobs] == expected
    from ddpkit.jobs import api

    table = api.sweep_status(sweeps.fn_array)  # the array was recorded like a submit's
    assert table is not None, "map_function's array has no sweep record"
    assert [(t.task, t.status.state.name, t.run, t.run_id) for t in table] == [
        (f"{sweeps.fn_array}_0", "COMPLETED", "lr=0.5,seed=1", f"slurm-{sweeps.fn_array}_0"),
        (f"{sweeps.fn_array}_1", "COMPLETED", "lr=0.25,seed=2", f"slurm-{sweeps.fn_array}_1"),
    ]


def test_a_one_run_sweep_is_one_plain_job_that_status_and_logs_find(sweeps: Sweeps) -> None:
    # submitit's map_array submits a single item as a plain job (no array, no SOLO_0)
    assert sweeps.states[sweeps.solo] == "COMPLETED"
    done = sweeps.ddpkit("status", sweeps.solo)
    shown = f"COMPLETED (exit code 0)\nrun slurm-{sweeps.solo} attempt 0\n"
    assert (done.returncode, done.stdout) == (0, shown), done.stderr
    logs = sweeps.ddpkit("logs", sweeps.solo, "--rank", "0")
    assert logs.returncode == 0, logs.stderr
    report = [json.loads(line) for line in logs.stdout.splitlines() if line.startswith("{")]
    assert [(r["argv"][:2], r["sweep"]) for r in report] == [
        (["--a", "solo"], {"DDPKIT_SWEEP_TASK": "0", "DDPKIT_SWEEP_RUN": "a=solo",
                          "DDPKIT_SWEEP_A": "solo"})
    ], logs.stdout  # fmt: skip


def test_the_dry_run_shows_the_script_that_was_submitted(sweeps: Sweeps) -> None:
    for job, values in ((sweeps.job, ",".join(VALUES)), (sweeps.solo, "solo")):
        done = sweeps.ddpkit("submit", "job.yaml", "--via", "submitit", "--sweep", f"a={values}",
                             "--dry-run")  # fmt: skip
        assert done.returncode == 0, done.stderr
        shown = done.stdout.partition("# sbatch script submitit would write:\n")[2]
        submitted = (sweeps.workdir / "logs" / f"{job}_submission.sh").read_text()
        assert shown.rstrip() == submitted.rstrip(), f"{shown}\n---- submitted:\n{submitted}"
