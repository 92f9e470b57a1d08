"""Sweeps without a cluster: expansion, run names, bad sweeps (one line, exit 2, nothing
submitted), the array script (golden, and executed under bash per task with hostile values),
the status table, a task's logs, submitit's map_array and torchx's refusal.

The real cluster's view (a 2 x 2 sweep of 2-node jobs, preemption of one task, cancel of
one task, MaxArraySize) is tests/jobs/test_sweep_cluster.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cluster.slurmtools import CommandResult, JobState, arrays
from ddpkit.errors import ConfigError
from ddpkit.jobs import api, render, sweep
from ddpkit.jobs.backends import sbatch as sbatch_backend
from ddpkit.jobs.load import load_spec
from ddpkit.jobs.records import JobRecord, save_record
from ddpkit.jobs.spec import JobSpec
from ddpkit.jobs.sweep_spec import unused_parameters
from tests.fakes.slurm import FakeSlurm, FakeTools
from tests.jobs.test_jobs_cli import assert_nothing_happened, calls, home, run, write_spec
from tests.support.golden import GOLDEN, check_golden

__all__ = ["calls", "home"]  # fixtures used here, defined in test_jobs_cli

HOSTILE = 'it\'s "dq"; $(touch pwned1) `touch pwned2` * 100%'


def sweep_spec(**fields: Any) -> JobSpec:
    base: dict[str, Any] = {
        "name": "sweep",
        "command": ["train.py", "--lr={lr}", "--seed", "{seed}", "--ck", "ck/{sweep_run}"],
        "python": "/opt/venv/bin/python",
        "workdir": "/srv/proj",
        "nodes": 2,
        "procs_per_node": 1,
        "sweep": {"params": {"lr": [0.1, 0.01], "seed": [1, 2]}, "max_parallel": 3},
    }
    return JobSpec.model_validate(base | fields)


# ---- expansion and names ----------------------------------------------------------------------


def test_grid_varies_the_last_parameter_fastest_and_zip_pairs_values() -> None:
    grid = sweep.expand({"lr": ["a", "b"], "seed": ["1", "2"]}, "grid")
    assert [tuple(c.values()) for c in grid] == [("a", "1"), ("a", "2"), ("b", "1"), ("b", "2")]
    zipped = sweep.expand({"lr": ["a", "b"], "seed": ["1", "2"]}, "zip")
    assert [tuple(c.values()) for c in zipped] == [("a", "1"), ("b", "2")]
    with pytest.raises(ValueError, match="lr: 2, seed: 1"):
        sweep.expand({"lr": ["a", "b"], "seed": ["1"]}, "zip")


def test_run_names_are_readable_stable_and_unique_when_values_sanitize_alike() -> None:
    combos = [{"path": "a/b"}, {"path": "a_b"}, {"path": "c"}]
    names = sweep.run_names(combos)
    assert names[2] == "path=c"
    assert names[0].startswith("path=a_b-") and names[1].startswith("path=a_b-")
    assert len(set(names)) == 3
    assert sweep.run_names(combos) == names  # from the values alone: a requeue finds them again
    assert (
        sweep.run_names([{"x": HOSTILE}])[0] == "x=it_s__dq_____touch_pwned1___touch_pwned2____100_"
    )


def test_placeholders_and_literal_braces() -> None:
    assert sweep.placeholders("--lr={lr}/{sweep_run}") == ["lr", "sweep_run"]
    assert sweep.substitute("{{x}}-{lr}", {"lr": "0.1"}) == "{x}-0.1"
    with pytest.raises(ValueError, match="not a plain placeholder"):
        sweep.split_word("{lr:.2f}")


# ---- bad sweeps: one line, exit 2, nothing submitted ------------------------------------------

BAD = {
    "unknown placeholder": (
        ["--sweep", "lr=0.1,0.01", "--set", "command=train.py --lr {lrr}"],
        "command='{lrr}': has the placeholder {lrr}, which is not a sweep parameter "
        "(hint: did you mean 'lr'?",
    ),
    "empty list": (["--sweep", "lr="], "--sweep: sweep.params.lr=[]: is an empty list"),
    "zip lengths": (
        ["--sweep", "lr=1,2", "--sweep", "seed=1", "--set", "sweep.mode=zip"],
        "zip needs lists of one length, these have lr: 2, seed: 1",
    ),
    "repeated": (["--sweep", "lr=1,1"], "tasks 0 and 1 would both run lr=1"),
    "bad name": (["--sweep", "learning-rate=1"], "sweep.params.learning-rate: is not a parameter"),
    "reserved name": (["--sweep", "task=1"], "is a name ddpkit uses itself"),
    "not NAME=": (["--sweep", "lr"], "--sweep 'lr' is not NAME=VALUE,VALUE"),
    "array option": (["--set", "sbatch.array=0-3"], "sbatch.array: is set by ddpkit"),
    "sweep env": (["--set", "env.DDPKIT_SWEEP_LR=1"], "env.DDPKIT_SWEEP_LR: is set by ddpkit"),
    "one run id": (
        ["--sweep", "lr=1,2", "--set", "env.DDPKIT_RUN_ID=bert"],
        "env.DDPKIT_RUN_ID='bert': would be the run id of every task of the sweep (one tracker "
        "run for all of them) (hint: leave it out: each task is its own run, "
        "slurm-<array id>_<task>)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sweeps_get_one_line_and_exit_2_with_nothing_submitted(
    case: str, tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, expected = BAD[case]
    code, out, err = run(["submit", str(write_spec(tmp_path)), *argv], capsys)
    assert (code, out) == (2, ""), err
    assert expected in err
    assert len(err.strip().splitlines()) == 1, err
    assert_nothing_happened(tmp_path, calls)


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_sweep_submitted_with_a_run_id_in_the_environment_is_refused(
    dry_run: list[str],
    tmp_path: Path,
    calls: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DDPKIT_RUN_ID", "bert")  # sbatch hands it on to every task
    argv = ["submit", str(write_spec(tmp_path)), "--sweep", "lr=1,2", *dry_run]
    argv += ["--set", "command=train.py --lr {lr}"]
    code, out, err = run(argv, capsys)
    assert (code, out) == (2, ""), err
    assert err == (
        "ddpkit: error: DDPKIT_RUN_ID='bert' (set where the sweep is submitted) would be the run "
        "id of every task of the sweep (one tracker run for all of them) (hint: unset it: each "
        "task is its own run, slurm-<array id>_<task>)\n"
    )
    assert_nothing_happened(tmp_path, calls)
    monkeypatch.setenv("DDPKIT_RUN_ID", "")  # empty names no run: the sweep goes through
    assert run(argv, capsys)[0] == 0


def test_map_function_refuses_a_run_id_in_the_environment_before_submitit_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ddpkit.jobs.backends import submitit as submitit_backend

    monkeypatch.setattr(submitit_backend, "map_function", pytest.fail)
    monkeypatch.setenv("DDPKIT_RUN_ID", "bert")
    with pytest.raises(ConfigError, match=r"^DDPKIT_RUN_ID='bert' \(set where the sweep is"):
        api.map_function(print, spec=sweep_spec())


def test_a_value_with_a_newline_in_yaml_is_refused(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_spec(tmp_path, 'sweep: {params: {lr: ["0.1", "0.2\\nrm -rf /"]}}\n')
    code, out, err = run(["submit", str(path)], capsys)
    assert (code, out) == (2, "")
    assert "sweep.params.lr[1]='0.2\\nrm -rf /': contains a line break" in err
    assert_nothing_happened(tmp_path, calls)


def test_more_runs_than_max_array_size_is_refused_with_nothing_written(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the fake scontrol answers `show config` with a small MaxArraySize (the real cluster's 1001
    # is checked in test_sweep_cluster.py); sbatch refuses the array as SLURM's does
    FakeTools(calls.parent / "bin").scontrol_config("MaxArraySize            = 3\n")
    monkeypatch.setenv("FAKE_SBATCH_FAIL", "Batch job submission failed: Invalid job array spec")
    code, out, err = run(["submit", str(write_spec(tmp_path)), "--sweep", "lr=1,2,3,4"], capsys)
    assert (code, out) == (2, "")
    assert "sweep has 4 runs, more than this cluster's MaxArraySize=3 allows" in err
    assert err.count("ddpkit: error:") == 1 and err.count("\n") <= 2, err  # and a warning
    assert not (tmp_path / "home").exists() and not (tmp_path / "ddpkit-logs").exists()
    # within the limit, sbatch's own refusal is what the user reads
    code, out, err = run(["submit", str(write_spec(tmp_path)), "--sweep", "lr=1,2,3"], capsys)
    assert code != 0 and "Invalid job array spec" in err and "MaxArraySize" not in err, err
    assert not (tmp_path / "home").exists() and not (tmp_path / "ddpkit-logs").exists()
    # plan and dry-run need no cluster
    code, out, _ = run(["plan", str(write_spec(tmp_path)), "--sweep", "lr=1,2,3,4"], capsys)
    assert code == 0
    assert "# sweep: 4 runs (grid), one SLURM array task each" in out


def test_a_sweep_sbatch_accepts_is_submitted_without_asking_for_max_array_size(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # MaxArraySize is asked only to explain a refusal: scontrol here records every call
    FakeTools(calls.parent / "bin", calls).scontrol_exits(0)
    code, out, err = run(["submit", str(write_spec(tmp_path)), "--sweep", "lr=1,2,3,4"], capsys)
    assert (code, out.strip()) == (0, "4242"), err
    assert "--array=0-3" in (calls / "sbatch.stdin").read_text()
    assert not (calls / "scontrol.args").exists(), (calls / "scontrol.args").read_text()


def test_cli_sweep_replaces_the_specs_params_and_plan_shows_the_runs(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_spec(tmp_path, "sweep: {params: {lr: [9]}, max_parallel: 2}\n")
    code, out, _ = run(["plan", str(path), "--sweep", "seed=1,2", "--sweep", "lr=0.1"], capsys)
    assert code == 0
    table = out.split("# sweep: 2 runs (grid, at most 2 at once)")[1].splitlines()[1:]
    assert table == [
        "task  seed  lr   run",
        "0     1     0.1  seed=1,lr=0.1",
        "1     2     0.1  seed=2,lr=0.1",
    ]


def test_a_parameter_the_command_never_names_is_warned_about_once(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the spec's command names no {placeholder}: every run would be the same run unless the
    # script reads DDPKIT_SWEEP_<NAME>; plan (and submit) say so, and still work
    path = write_spec(tmp_path, "sweep: {params: {lr: [0.1, 0.01]}}\n")
    code, out, err = run(["plan", str(path), "--sweep", "seed=1,2"], capsys)
    assert code == 0 and "# sweep: 2 runs" in out
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings == [
        "ddpkit: warning: sweep parameter 'seed' is not a {seed} placeholder in command: its "
        "values reach the ranks only as $DDPKIT_SWEEP_SEED (add e.g. '--seed {seed}' to "
        "command, unless the script reads that variable)"
    ]
    used = sweep_spec()  # its command names {lr} and {seed}: nothing to warn about
    assert used.sweep is not None and unused_parameters(used.command, used.sweep) == []


# ---- the array script -------------------------------------------------------------------------


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_golden_array_script(launch: str) -> None:
    text = render.render_sbatch(sweep_spec(launch=launch, rdzv_port="auto"))
    check_golden(GOLDEN / f"{launch}-sweep.sbatch", text, what="rendered array script")
    assert "#SBATCH --array=0-3%3\n" in text


def _run_task(text: str, tmp_path: Path, task: str) -> tuple[list[str], dict[str, str], str]:
    """Run the array script as SLURM would run task ``task``: srun's argv and env, stderr."""
    stubs, records = tmp_path / "stubs", tmp_path / f"records-{task}"
    FakeTools(stubs).recorders("srun", "scontrol")
    records.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "RECORD_DIR": str(records),
        "SLURM_JOB_ID": "4243",
        "SLURM_ARRAY_JOB_ID": "4240",
        "SLURM_ARRAY_TASK_ID": task,
    }
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    srun = [path for path in records.iterdir() if path.name.startswith("srun.")]
    if not srun:
        return [], {}, done.stderr
    argv = (srun[0] / "argv").read_bytes().decode().split("\0")[:-1]
    pairs = (srun[0] / "env").read_bytes().decode().split("\0")[:-1]
    return argv, dict(pair.split("=", 1) for pair in pairs), done.stderr


def test_each_task_runs_with_its_own_values_quoted_intact(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    spec = sweep_spec(
        workdir=str(work), signal=None, sweep={"params": {"lr": ["0.1", HOSTILE], "seed": [7]}}
    )
    text = render.render_sbatch(spec)
    argv, env, _ = _run_task(text, tmp_path, "1")
    assert argv[-6:] == [
        "train.py",
        f"--lr={HOSTILE}",
        "--seed",
        "7",
        "--ck",
        f"ck/{spec.sweep.tasks[1].run}",
    ]
    assert env["DDPKIT_SWEEP_LR"] == HOSTILE
    assert (env["DDPKIT_SWEEP_TASK"], env["DDPKIT_SWEEP_SEED"]) == ("1", "7")
    run_dir = work / "ddpkit-logs" / env["DDPKIT_SWEEP_RUN"]
    assert run_dir.is_dir()
    assert f"--output={run_dir}/sweep-4240_1-rank%t.out" in argv
    assert not list(tmp_path.rglob("pwned*")), "a value ran as shell code"
    argv, env, _ = _run_task(text, tmp_path, "0")
    assert "--lr=0.1" in argv and env["DDPKIT_SWEEP_RUN"] == "lr=0.1,seed=7"
    argv, _, err = _run_task(text, tmp_path, "2")  # not a task of this sweep: no step at all
    assert argv == [] and "SLURM_ARRAY_TASK_ID=2 is not a task of this sweep (0-1)" in err


# ---- status, logs, submitit, torchx ----------------------------------------------------------


def _tools(squeue: str, sacct: str, scontrol: str) -> FakeSlurm:
    return FakeSlurm(
        squeue=CommandResult(0, squeue, ""),
        sacct=CommandResult(0, sacct, ""),
        scontrol=CommandResult(0, scontrol, ""),
    )


def test_every_task_gets_its_state_from_one_call_per_tool() -> None:
    runner = _tools(
        squeue="7_1|RUNNING\n7_[3-4%2]|PENDING\n",
        # sacct lags: it still calls task 2 pending, scontrol knows it was cancelled
        sacct="7_0|COMPLETED|0:0\n7_1|RUNNING|0:0\n7_[2-4%2]|PENDING|0:0\n",
        scontrol="JobId=9 ArrayJobId=7 ArrayTaskId=2 JobState=CANCELLED ExitCode=0:15\n",
    )
    states = arrays.query_array("7", 6, runner=runner).states
    assert {task: status.state for task, status in states.items()} == {
        0: JobState.COMPLETED,
        1: JobState.RUNNING,
        2: JobState.CANCELLED,
        3: JobState.PENDING,
        4: JobState.PENDING,
        5: JobState.UNKNOWN,
    }
    assert states[2].source == "scontrol" and states[0].source == "sacct"


def test_every_task_gets_its_attempt_from_the_one_scontrol_call() -> None:
    runner = _tools(
        squeue="7_1|PENDING\n7_[3-4%2]|PENDING\n",
        sacct="7_1|REQUEUED|0:0\n7_2|COMPLETED|0:0\n7_[3-4%2]|PENDING|0:0\n",
        # task 1 requeued twice and pending again, task 2 ran once, 3-4 never ran, the
        # controller has forgotten task 0 (and 5 was never listed)
        scontrol=(
            "JobId=9 ArrayJobId=7 ArrayTaskId=1 JobState=PENDING Restarts=2 ExitCode=0:0\n"
            "JobId=10 ArrayJobId=7 ArrayTaskId=2 JobState=COMPLETED Restarts=0 ExitCode=0:0\n"
            "JobId=7 ArrayJobId=7 ArrayTaskId=3-4%2 JobState=PENDING Restarts=0 ExitCode=0:0\n"
        ),
    )
    found = arrays.query_array("7", 6, runner=runner)
    assert found.restarts == {1: 2, 2: 0, 3: 0, 4: 0}
    assert {task: status.state for task, status in found.states.items()} == {
        0: JobState.UNKNOWN,
        1: JobState.PENDING,
        2: JobState.COMPLETED,
        3: JobState.PENDING,
        4: JobState.PENDING,
        5: JobState.UNKNOWN,
    }
    assert runner.tools() == ["squeue", "sacct", "scontrol"]  # one call each, for six tasks


def _record_sweep(tmp_path: Path, via: str = "sbatch") -> Path:
    logs = tmp_path / "logs"
    logs.mkdir()
    save_record(
        JobRecord(
            job_id="77",
            via="submitit" if via == "submitit" else "sbatch",
            name="demo",
            log_dir=str(logs),
            launch="srun",
            nodes=2,
            procs_per_node=1,
            workdir=str(tmp_path),
            sweep_runs=("lr=1", "lr=2"),
        )
    )
    return logs


def test_status_of_a_sweep_is_one_table_and_a_task_is_one_line(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _record_sweep(tmp_path)
    runner = _tools(
        "77_1|RUNNING\n",
        "77_0|FAILED|3:0\n77_1|RUNNING|0:0\n",
        "JobId=79 ArrayJobId=77 ArrayTaskId=1 JobState=RUNNING Restarts=1 ExitCode=0:0\n",
    )
    monkeypatch.setattr(
        sbatch_backend, "query_array", lambda job, n: arrays.query_array(job, n, runner=runner)
    )
    code, out, _ = run(["status", "77"], capsys)
    assert code == 0
    # task 0 is forgotten by the controller: its attempt is unknown ("-")
    assert out.splitlines() == [
        "task  state                 attempt  run id      run",
        "77_0  FAILED (exit code 3)  -        slurm-77_0  lr=1",
        "77_1  RUNNING               1        slurm-77_1  lr=2",
        "# 2 runs: 1 FAILED, 1 RUNNING",
    ]
    assert api.sweep_status("77_1") is None  # one task: status() answers, as for any job


def test_logs_of_one_task_read_its_run_folder_and_follow_labels_every_task(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    logs = _record_sweep(tmp_path)
    (logs / "demo-77_1.out").write_text("batch of task 1\n")
    for task, run_name in enumerate(("lr=1", "lr=2")):
        (logs / run_name).mkdir()
        for rank in (0, 1):
            (logs / run_name / f"demo-77_{task}-rank{rank}.out").write_text(f"t{task} r{rank}\n")
    assert run(["logs", "77_1", "--rank", "1"], capsys) == (0, "t1 r1\n", "")
    code, out, _ = run(["logs", "77_1"], capsys)
    assert code == 0 and "batch of task 1" in out and "t1 r0" in out and "t0" not in out
    monkeypatch.setattr(
        api, "status", lambda job: api.JobStatus(JobState.COMPLETED, "", 0, "sacct")
    )
    assert list(api.follow_logs("77", rank=1, sleep=pytest.fail)) == [
        "[task 0 rank 1] t0 r1\n",
        "[task 1 rank 1] t1 r1\n",
    ]


def test_submitit_maps_the_sweep_and_torchx_refuses_it() -> None:
    from ddpkit.jobs.backends import submitit as submitit_backend
    from ddpkit.jobs.backends.torchx_appdef import refuse_sweep

    spec = sweep_spec()
    runs = submitit_backend.sweep_runs(spec)
    assert [r.command[3] for r in runs] == ["--lr=0.1", "--lr=0.1", "--lr=0.01", "--lr=0.01"]
    assert runs[3].env["DDPKIT_SWEEP_RUN"] == "lr=0.01,seed=2"
    assert runs[3].command[-1] == "ck/lr=0.01,seed=2"
    assert submitit_backend.executor_parameters(spec)["slurm_array_parallelism"] == 3
    with pytest.raises(ConfigError, match="cannot go through torchx, which has no job arrays"):
        refuse_sweep(spec)


def test_submitit_dry_run_of_a_sweep_shows_the_array_script_map_array_writes(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    FakeTools(calls.parent / "bin").srun()  # submitit builds its script only next to srun
    spec = write_spec(tmp_path, "sweep: {max_parallel: 2, params: {lr: [1, 2, 3]}}\n")
    code, out, err = run(["submit", str(spec), "--via", "submitit", "--dry-run"], capsys)
    assert code == 0, err
    script = out.partition("# sbatch script submitit would write:\n")[2].splitlines()
    assert "#SBATCH --array=0-2%2" in script, out
    assert f"#SBATCH --output={tmp_path}/ddpkit-logs/%A_%a_0_log.out" in script, out
    assert_nothing_happened(tmp_path, calls)
    # one run: submitit's map_array submits a plain job, and the dry run shows that
    spec.write_text(spec.read_text().replace("[1, 2, 3]", "[1]"))
    code, out, _ = run(["submit", str(spec), "--via", "submitit", "--dry-run"], capsys)
    assert code == 0 and "--array" not in out and "/%j_0_log.out" in out, out


def test_a_one_run_sweep_through_submitit_is_recorded_as_the_plain_job_it_is(
    tmp_path: Path,
) -> None:
    from types import SimpleNamespace

    from ddpkit.jobs.backends import submitit as submitit_backend

    spec = sweep_spec(sweep={"params": {"lr": ["0.1"], "seed": ["1", "2"]}})
    paths = SimpleNamespace(submission_file=tmp_path / "7_submission.sh")
    paths.submission_file.write_text("#!/bin/bash\n")

    def job(job_id: str) -> Any:  # what map_array returns: its job ids and paths matter here
        return SimpleNamespace(job_id=job_id, paths=paths)

    array = submitit_backend.sweep_record(spec, [job("7_0"), job("7_1")])
    assert (array.job_id, array.sweep_runs) == ("7", ("lr=0.1,seed=1", "lr=0.1,seed=2"))
    assert array.script == "#!/bin/bash\n" and array.via == "submitit"
    # submitit submits a single item as job 7 (not 7_0): no array tasks to list
    plain = submitit_backend.sweep_record(spec, [job("7")])
    assert (plain.job_id, plain.sweep_runs) == ("7", None)
    assert (array.run_id, plain.run_id) == (None, "slurm-7")  # a task's: slurm-7_<task>


def test_the_sweep_section_loads_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: s\ncommand: t.py --lr {lr}\nsweep:\n  mode: zip\n  params:\n"
        "    lr: [0.1, 0.2]\n    seed: [1, 2]\n"
    )
    spec = load_spec(path)
    assert spec.sweep is not None
    assert [t.run for t in spec.sweep.tasks] == ["lr=0.1,seed=1", "lr=0.2,seed=2"]


def test_a_map_function_task_unpickles_its_call_without_ddpkits_submission_side(
    tmp_path: Path, calls: Path
) -> None:
    """Each task of map_function's array unpickles its call before it runs: that must import
    no more than submitit's own map_array does (the call's class once lived in the submitit
    backend, and every task paid 0.2 s of YAML, Jinja2 and spec models before the function)."""
    import sys

    tools = FakeTools(calls.parent / "bin")
    tools.srun()
    tools.install("sbatch", "#!/bin/sh\necho Submitted batch job 77\n")  # as submitit reads it
    spec = api.load(write_spec(tmp_path, "sweep: {params: {lr: ['0.1', '0.2']}}\n"))
    jobs = api.map_function(dict, spec=spec)  # dict(**values): importable anywhere
    assert [job.job_id for job in jobs] == ["77_0", "77_1"]
    task = Path(spec.log_path) / "77_1_submitted.pkl"
    code = (
        "import pickle, sys\n"
        f"call = pickle.loads(open({str(task)!r}, 'rb').read())\n"
        "print(call.function(*call.args, **call.kwargs))\n"
        "heavy = {'yaml', 'jinja2', 'pydantic', 'torch'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy\n"
        "             or m.startswith(('ddpkit.jobs.backends', 'ddpkit.jobs.spec'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["{'lr': '0.2'}", "[]"], done.stdout


def test_a_call_pickled_under_its_old_name_still_loads() -> None:
    """Arrays submitted before the move pickled ``ddpkit.jobs.backends.submitit._Call``: a
    task of one that is requeued now unpickles it from there."""
    import pickle

    from ddpkit.jobs.keyword_call import KeywordCall

    old = pickle.dumps(KeywordCall(dict, {"lr": "0.1"}), protocol=0).replace(
        b"ddpkit.jobs.keyword_call\nKeywordCall", b"ddpkit.jobs.backends.submitit\n_Call"
    )
    assert b"_Call" in old
    loaded = pickle.loads(old)
    assert type(loaded) is KeywordCall and loaded() == {"lr": "0.1"}
