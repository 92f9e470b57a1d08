"""``ddpkit plan|submit|status|logs|cancel`` in-process, without a cluster; job records.

SLURM's clients are replaced by tests/fakes/slurm.py's shell scripts on PATH (a ``sbatch`` that
keeps the script it was given and prints a job id; a ``scontrol`` that knows nothing or one
job), so the tests see exactly what would reach SLURM and whether anything did. The real cluster is
tests/jobs/test_jobs_cluster.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from ddpkit.cli import main
from ddpkit.cluster.slurmtools import CommandResult, JobState, JobStatus
from ddpkit.errors import ConfigError
from ddpkit.jobs import api
from ddpkit.jobs.layout import format_plan
from ddpkit.jobs.load import load_spec
from ddpkit.jobs.records import (
    JobRecord,
    ddpkit_home,
    load_record,
    new_record,
    record_path,
    recorded_run_id,
    save_record,
    submitted_run_id,
)
from ddpkit.jobs.render import render_sbatch
from tests.fakes.slurm import FakeSlurm, FakeTools, scontrol_line

JOB_ID = "4242"


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Fake SLURM clients first on PATH; the directory where they leave what they were given."""
    tools = FakeTools(tmp_path / "bin", tmp_path / "calls")
    tools.sbatch(JOB_ID)
    tools.scontrol_jobs()
    monkeypatch.setenv("PATH", tools.path())
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FAKE_SBATCH_FAIL", raising=False)
    monkeypatch.delenv("FAKE_SCONTROL_JOB", raising=False)
    monkeypatch.chdir(tmp_path)
    return tools.calls


@pytest.fixture
def home(calls: Path, tmp_path: Path) -> Path:
    return tmp_path / "home"


def write_spec(tmp_path: Path, text: str = "", name: str = "job.yaml") -> Path:
    """A spec file: a 2 x 2 job running a script, plus ``text`` (more YAML lines)."""
    base = "name: demo\ncommand: train.py --lr 0.1\nnodes: 2\nprocs_per_node: 2\n"
    path = tmp_path / name
    path.write_text(base + text)
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_nothing_happened(tmp_path: Path, calls: Path) -> None:
    assert not (tmp_path / "home").exists(), "a job record (or its folder) was written"
    assert not (calls / "sbatch.stdin").exists(), "sbatch was called"
    assert not (tmp_path / "ddpkit-logs").exists(), "the log directory was created"


# --- the command line stays light -------------------------------------------------------------


def test_parsing_imports_neither_torch_nor_pydantic_nor_jinja() -> None:
    code = (
        "import sys\n"
        "from ddpkit.cli import main\n"
        "main(['submit', '--help']); main(['logs', 'not-a-job'])\n"
        "heavy = {'torch', 'pydantic', 'jinja2', 'submitit', 'yaml'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "ddpkit: error: job_id='not-a-job' is not a SLURM job id" in done.stderr


# --- plan and dry runs ------------------------------------------------------------------------


def test_plan_prints_the_resolved_spec_and_layout_with_overrides(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(tmp_path)
    code, out, err = run(["plan", str(spec), "--set", "nodes=3"], capsys)
    assert (code, err) == (0, "")
    assert out == format_plan(load_spec(spec, ["nodes=3"]))
    assert "nodes: 3" in out
    assert "world size 6" in out
    assert_nothing_happened(tmp_path, calls)


def test_dry_run_prints_exactly_the_script_that_submit_hands_to_sbatch(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(tmp_path, 'env:\n  TOKEN: "a b\'c; $(x)"\n')
    code, dry, err = run(["submit", str(spec), "--dry-run", "--set", "time_min=5"], capsys)
    assert (code, err) == (0, "")
    assert dry == render_sbatch(load_spec(spec, ["time_min=5"]))
    assert_nothing_happened(tmp_path, calls)

    code, out, err = run(["submit", str(spec), "--set", "time_min=5"], capsys)
    assert (code, out, err) == (0, f"{JOB_ID}\n", "")
    assert (calls / "sbatch.stdin").read_text() == dry
    assert "--parsable" in (calls / "sbatch.args").read_text().split()


def test_submit_records_the_job_atomically(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(tmp_path, "launch: torchrun\nrdzv_port: auto\nlog_dir: out/logs\n")
    code, out, _ = run(["submit", str(spec)], capsys)
    assert (code, out) == (0, f"{JOB_ID}\n")
    record = load_record(JOB_ID)
    assert record is not None
    assert record.job_id == JOB_ID
    assert (record.via, record.name, record.launch) == ("sbatch", "demo", "torchrun")
    assert (record.nodes, record.procs_per_node) == (2, 2)
    assert record.log_dir == str(tmp_path / "out" / "logs")
    assert Path(record.log_dir).is_dir()  # SLURM opens the output files there before the job
    assert record.script == render_sbatch(load_spec(spec))
    assert record.workdir == str(tmp_path)
    assert sorted(p.name for p in (home / "jobs").iterdir()) == [f"{JOB_ID}.json"]  # no temp


def test_submitit_dry_run_prints_the_executor_parameters_and_writes_nothing(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeTools(calls.parent / "bin").srun()  # submitit builds its script only next to srun
    spec = write_spec(
        tmp_path,
        "mem_gb: 1.5\npartition: debug\nsetup: [module load x]\nenv: {A: 'x y'}\n"
        "sbatch: {exclusive: true, comment: hi}\n",
    )
    code, out, err = run(["submit", str(spec), "--via", "submitit", "--dry-run"], capsys)
    assert (code, err) == (0, "")
    head, _, script = out.partition("# sbatch script submitit would write:\n")
    shown = yaml.safe_load(head)
    assert shown["folder"] == str(tmp_path / "ddpkit-logs")
    assert shown["command"] == [sys.executable, "-u", "train.py", "--lr", "0.1"]
    assert shown["parameters"] == {
        "name": "demo",
        "nodes": 2,
        "tasks_per_node": 2,
        "cpus_per_task": 1,
        "timeout_min": 60,
        "stderr_to_stdout": True,
        "slurm_setup": [
            "module load x",
            "export A='x y'",
            "export DDPKIT_EXPECTED_WORLD_SIZE=4",
            "export DDPKIT_JOB_LAUNCH=srun",
            "export DDPKIT_SIGNAL=USR2",
            "export DDPKIT_MAX_REQUEUES=10",
            f"export DDPKIT_LOG_DIR={tmp_path / 'ddpkit-logs'}",
            "export SUBMITIT_PREEMPT_SIGNAL=USR2",
        ],
        "slurm_additional_parameters": {
            "exclusive": True,
            "comment": "hi",
            "chdir": str(tmp_path),
            "signal": "USR2@120",  # the spec's signal and delay beat submitit's USR2@90
        },
        "mem_gb": 1.5,
        "slurm_partition": "debug",
    }
    assert "#SBATCH --signal=USR2@90" not in script.splitlines()
    for line in (
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --exclusive",
        "#SBATCH --mem=1536MB",
        "#SBATCH --signal=USR2@120",
    ):
        assert line in script.splitlines()
    assert "export A='x y'" in script
    assert_nothing_happened(tmp_path, calls)

    monkeypatch.setenv("PATH", str(calls.parent / "empty"))  # no srun: parameters only
    code, out, _ = run(["submit", str(spec), "--via", "submitit", "--dry-run"], capsys)
    assert code == 0
    assert out.startswith(head)
    assert out.endswith(
        "# sbatch script: not shown (via 'submitit' cannot reach SLURM: "
        'Could not detect "srun", are you indeed on a slurm cluster?)\n'
    )


# --- bad input: one line, exit 2, nothing submitted or written --------------------------------

BAD_INPUT: list[tuple[str, list[str], str]] = [
    ("nodez: 3\n", [], "did you mean 'nodes'"),
    ("", ["--set", "nodes=0"], "nodes"),
    ("launch: torchrun\n", ["--set", "rdzv_port=0"], "rdzv_port=0"),
    ("", ["--set", "nodes=two"], "nodes"),
    ("", ["--set", "nodes"], "--set"),
    ("name: 'a b'\n", [], "name"),
    ('sbatch: {comment: "a\\nb"}\n', [], "sbatch.comment"),
    ('env: {"FOO\\n": x}\n', [], "env['FOO\\n']"),
    ('sbatch: {"exclusive\\n": true}\n', [], "sbatch['exclusive\\n']"),
    ("", ["--set", 'name="demo\\n"'], "name='demo\\n'"),
]


@pytest.mark.parametrize("via", ["sbatch", "submitit"])
@pytest.mark.parametrize("case", BAD_INPUT, ids=[c[2] for c in BAD_INPUT])
def test_bad_spec_is_one_line_exit_2_and_nothing_happens(
    tmp_path: Path,
    calls: Path,
    capsys: pytest.CaptureFixture[str],
    case: tuple[str, list[str], str],
    via: str,
) -> None:
    extra, flags, names = case
    spec = write_spec(tmp_path, extra)
    for dry in ([], ["--dry-run"]):
        code, out, err = run(["submit", str(spec), "--via", via, *flags, *dry], capsys)
        assert (code, out) == (2, "")
        assert err.startswith("ddpkit: error: ")
        assert err.count("\n") == 1, err
        assert names in err
        assert_nothing_happened(tmp_path, calls)


def test_torchrun_launch_cannot_go_through_submitit(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(tmp_path, "launch: torchrun\nrdzv_port: auto\n")
    for dry in ([], ["--dry-run"]):
        code, out, err = run(["submit", str(spec), "--via", "submitit", *dry], capsys)
        assert (code, out) == (2, "")
        assert err.startswith("ddpkit: error: launch='torchrun' cannot go through submitit")
        assert "hint: submit it with --via sbatch, or set launch: srun" in err
        assert_nothing_happened(tmp_path, calls)


def test_missing_spec_file_and_bad_flags_exit_2(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["submit", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2
    assert err.startswith("ddpkit: error: ") and "nope.yaml" in err
    code, _, err = run(["submit", str(write_spec(tmp_path)), "--via", "pbs"], capsys)
    assert code == 2 and "invalid choice: 'pbs'" in err
    for argv in (["status", "12;rm -rf /"], ["cancel", "../x"], ["logs", "7", "--rank", "-1"]):
        code, out, err = run(argv, capsys)
        assert (code, out) == (2, "")
        assert err.startswith("ddpkit: error: ") and err.count("\n") == 1
    assert_nothing_happened(tmp_path, calls)


def test_failed_submission_writes_no_record_and_removes_the_log_dir(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SBATCH_FAIL", "invalid partition specified: gpu")
    code, out, err = run(["submit", str(write_spec(tmp_path))], capsys)
    assert (code, out) == (4, "")  # the scheduler refused: 4, not bad input's 2
    assert "invalid partition specified: gpu" in err
    assert not (tmp_path / "home").exists()
    assert not (tmp_path / "ddpkit-logs").exists()


def test_submitit_missing_names_the_extra_to_install(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "submitit", None)  # import submitit -> ImportError
    for dry in ([], ["--dry-run"]):
        code, out, err = run(
            ["submit", str(write_spec(tmp_path)), "--via", "submitit", *dry], capsys
        )
        assert (code, out) == (2, "")
        assert "pip install ddpkit[submitit]" in err
        assert_nothing_happened(tmp_path, calls)


# --- logs -------------------------------------------------------------------------------------


def record_job(tmp_path: Path, via: str = "sbatch", launch: str = "srun") -> Path:
    log_dir = tmp_path / "logs"
    log_dir.mkdir(exist_ok=True)
    save_record(
        JobRecord(
            job_id="77",
            via="submitit" if via == "submitit" else "sbatch",
            name="demo",
            log_dir=str(log_dir),
            launch=launch,
            nodes=2,
            procs_per_node=2,
            workdir=str(tmp_path),
        )
    )
    return log_dir


def test_logs_srun_mode_batch_then_ranks_in_rank_order(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = record_job(tmp_path)
    for name, text in {
        "demo-77.out": "batch line\n",
        "demo-77-rank0.out": "zero\n",
        "demo-77-rank1.out": "one\n",
        "demo-77-rank10.out": "ten\n",
        "demo-7-rank1.out": "another job\n",
        "other-77-rank1.out": "another name\n",
    }.items():
        (logs / name).write_text(text)
    code, out, _ = run(["logs", "77"], capsys)
    assert code == 0
    assert out == "".join(
        f"==> {logs / name} <==\n{text}"
        for name, text in [
            ("demo-77.out", "batch line\n"),
            ("demo-77-rank0.out", "zero\n"),
            ("demo-77-rank1.out", "one\n"),
            ("demo-77-rank10.out", "ten\n"),
        ]
    )
    assert run(["logs", "77", "--rank", "1"], capsys) == (0, "one\n", "")
    code, out, err = run(["logs", "77", "--rank", "5"], capsys)
    assert (code, out) == (1, "")
    assert f"looked for {logs}/demo-77" in err and "job record" in err


def test_logs_torchrun_mode_filters_node_files_by_rank_prefix(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = record_job(tmp_path, launch="torchrun")
    (logs / "demo-77.out").write_text("ddpkit: c10d rendezvous endpoint n1:29400\n")
    (logs / "demo-77-node0.out").write_text("[rank0]: a\n[rank1]: b\n[rank0]: c\n")
    (logs / "demo-77-node1.out").write_text("[rank2]: d\n[rank3]: e\n[rank12]: not 1\n")
    assert run(["logs", "77", "--rank", "0"], capsys) == (0, "[rank0]: a\n[rank0]: c\n", "")
    assert run(["logs", "77", "--rank", "3"], capsys) == (0, "[rank3]: e\n", "")
    code, out, _ = run(["logs", "77"], capsys)
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("==>")] == [
        f"==> {logs / name} <=="
        for name in ("demo-77.out", "demo-77-node0.out", "demo-77-node1.out")
    ]


def test_logs_submitit_files_are_per_task(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = record_job(tmp_path, via="submitit")
    (logs / "77_0_log.out").write_text("task zero\n")
    (logs / "77_1_log.out").write_text("task one\n")
    (logs / "77_submission.sh").write_text("#!/bin/bash\n")
    assert run(["logs", "77", "--rank", "1"], capsys) == (0, "task one\n", "")
    zero, one = logs / "77_0_log.out", logs / "77_1_log.out"
    expected = f"==> {zero} <==\ntask zero\n==> {one} <==\ntask one\n"
    assert run(["logs", "77"], capsys) == (0, expected, "")


def test_logs_without_record_ask_slurm_then_say_where_they_looked(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run(["logs", "55"], capsys)
    assert (code, out) == (1, "")
    assert f"looked for {tmp_path}/ddpkit-logs/*-55" in err
    assert f"no job record {tmp_path}/home/jobs/55.json" in err
    assert "SLURM does not know the job" in err

    elsewhere = tmp_path / "site logs"
    elsewhere.mkdir()
    (elsewhere / "train-55.out").write_text("batch\n")
    (elsewhere / "train-55-rank0.out").write_text("rank zero\n")
    monkeypatch.setenv(
        "FAKE_SCONTROL_JOB",
        f"JobId=55 JobName=train StdErr={elsewhere}/train-55.out StdIn=/dev/null "
        f"StdOut={elsewhere}/train-55.out Power=",
    )
    assert run(["logs", "55", "--rank", "0"], capsys) == (0, "rank zero\n", "")


def test_follow_streams_new_lines_and_late_files_until_the_job_ends(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logs = record_job(tmp_path)
    batch, rank1 = logs / "demo-77.out", logs / "demo-77-rank1.out"
    batch.write_text("start\npart")
    states = iter([JobState.RUNNING, JobState.RUNNING, JobState.COMPLETING, JobState.COMPLETED])
    monkeypatch.setattr(api, "status", lambda job: JobStatus(next(states), "", None, "squeue"))
    steps = iter([
        lambda: batch.write_text("start\npartial line\n"),
        lambda: rank1.write_text("rank one\nno newline"),
        lambda: None,
    ])  # fmt: skip
    chunks = list(api.follow_logs("77", poll_s=0, sleep=lambda _: next(steps)()))
    assert chunks == [
        "[batch] start\n",
        "[batch] partial line\n",  # held back until its newline arrived
        "[rank 1] rank one\n",
        "[rank 1] no newline\n",  # flushed once the job is over, as a line of its own
    ]
    states = iter([JobState.COMPLETED])
    assert list(api.follow_logs("77", rank=1, sleep=pytest.fail)) == ["rank one\nno newline"]


# --- records ----------------------------------------------------------------------------------


def test_record_round_trip_home_default_and_bad_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path))
    record = JobRecord("9_1", "sbatch", "x", "/l", "srun", 1, 1, "/w", script="#!/bin/bash\n")
    path = save_record(record)
    assert path == tmp_path / "jobs" / "9_1.json"
    assert load_record("9_1") == record
    assert load_record("10") is None
    assert ddpkit_home({}) == Path.home() / ".cache" / "ddpkit"
    assert ddpkit_home({"DDPKIT_HOME": "~/x"}) == Path.home() / "x"
    with pytest.raises(ConfigError, match="not a SLURM job id"):
        record_path("../../etc/passwd")
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"cannot be read.*hint: delete the file"):
        load_record("9_1")
    path.write_text(json.dumps({"job_id": "9_1"}))
    with pytest.raises(ConfigError, match="not a ddpkit job record"):
        load_record("9_1")


def test_status_prints_state_exit_code_and_says_when_slurm_does_not_know(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path))  # no record: no run line
    answers: Iterator[JobStatus] = iter([
        JobStatus(JobState.FAILED, "FAILED", 3, "scontrol"),
        JobStatus(JobState.CANCELLED, "CANCELLED by 0", 0, "sacct", signal=15),
        JobStatus(JobState.RUNNING, "R", None, "squeue"),
        JobStatus(JobState.UNKNOWN, "", None, "none", hint="job 12: squeue not listed"),
    ])  # fmt: skip
    monkeypatch.setattr(api, "status", lambda job: next(answers))
    assert run(["status", "12"], capsys) == (0, "FAILED (exit code 3)\n", "")
    assert run(["status", "12"], capsys) == (0, "CANCELLED (exit code 0, signal 15)\n", "")
    assert run(["status", "12"], capsys) == (0, "RUNNING\n", "")
    assert run(["status", "12"], capsys) == (1, "UNKNOWN\n", "ddpkit: job 12: squeue not listed\n")


def test_follow_does_not_wait_for_a_job_slurm_does_not_know(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = record_job(tmp_path)
    (logs / "demo-77-rank0.out").write_text("last words")
    unknown = JobStatus(JobState.UNKNOWN, "", None, "none", hint="forgotten")
    monkeypatch.setattr(api, "status", lambda job: unknown)
    assert run(["logs", "77", "--rank", "0", "--follow"], capsys) == (0, "last words", "")


# --- run identity in records and status -------------------------------------------------------


def test_submit_records_the_run_id_the_ranks_will_have(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DDPKIT_RUN_ID", raising=False)
    spec = write_spec(tmp_path)
    assert run(["submit", str(spec)], capsys)[:2] == (0, f"{JOB_ID}\n")
    assert load_record(JOB_ID) == replace(load_record(JOB_ID), run_id=f"slurm-{JOB_ID}")  # type: ignore[type-var]
    named = write_spec(tmp_path, "env: {DDPKIT_RUN_ID: bert-3}\n", name="named.yaml")
    assert run(["submit", str(named)], capsys)[0] == 0
    assert load_record(JOB_ID).run_id == "bert-3"  # type: ignore[union-attr]
    monkeypatch.setenv("DDPKIT_RUN_ID", "from-shell")  # sbatch passes the environment on
    assert run(["submit", str(spec)], capsys)[0] == 0
    assert load_record(JOB_ID).run_id == "from-shell"  # type: ignore[union-attr]
    assert run(["submit", str(named)], capsys)[0] == 0  # the spec's env wins, as in the job
    assert load_record(JOB_ID).run_id == "bert-3"  # type: ignore[union-attr]


def test_submitted_run_id_rules(tmp_path: Path) -> None:
    assert submitted_run_id({}, "12", {}) == "slurm-12"
    assert submitted_run_id({}, None, {}) is None  # not a SLURM job: the launch names it
    assert submitted_run_id({}, "12", {"DDPKIT_RUN_ID": "a.b-c"}) == "a.b-c"
    assert submitted_run_id({"DDPKIT_RUN_ID": "x"}, "12", {"DDPKIT_RUN_ID": "y"}) == "x"
    assert submitted_run_id({}, "12", {"DDPKIT_RUN_ID": "no way"}) is None  # ranks refuse it
    assert submitted_run_id({}, "12", {}, array=True) is None  # every task has its own
    sweep = write_spec(tmp_path, "sweep: {params: {lr: [1, 2]}}\n", name="sweep.yaml")
    assert new_record(load_spec(sweep), "12", "sbatch", None, env={}).run_id is None


def test_old_records_without_a_run_id_still_load(tmp_path: Path) -> None:
    record = JobRecord("31", "sbatch", "x", "/l", "srun", 1, 1, "/w", run_id="slurm-31")
    path = save_record(record, home=tmp_path)
    data = json.loads(path.read_text())
    assert data["run_id"] == "slurm-31"
    del data["run_id"]  # as ddpkit wrote records before the field
    path.write_text(json.dumps(data))
    old = load_record("31", home=tmp_path)
    assert old == replace(record, run_id=None)
    assert recorded_run_id(old, "31") is None  # unknown, not guessed
    assert recorded_run_id(None, "31") is None
    sweep = replace(record, run_id=None, sweep_runs=("lr=1", "lr=2"))
    assert recorded_run_id(sweep, "31_1") == "slurm-31_1"  # a task of a sweep: SLURM's rule
    assert recorded_run_id(sweep, "31") is None


def test_status_prints_the_run_id_and_slurms_restart_count_as_the_attempt(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    record = JobRecord("77", "sbatch", "demo", str(tmp_path), "srun", 1, 1, str(tmp_path))
    monkeypatch.setattr(api, "status", lambda job: JobStatus(JobState.RUNNING, "R", None, "squeue"))
    save_record(replace(record, run_id="slurm-77"))
    line = scontrol_line("77", "RUNNING").replace("Restarts=0", "Restarts=2")
    monkeypatch.setenv("FAKE_SCONTROL_JOB", line)
    assert run(["status", "77"], capsys) == (0, "RUNNING\nrun slurm-77 attempt 2\n", "")
    monkeypatch.delenv("FAKE_SCONTROL_JOB")  # the controller forgot the job: no attempt
    assert run(["status", "77"], capsys) == (0, "RUNNING\nrun slurm-77\n", "")
    save_record(record)  # an old record: no run line
    assert run(["status", "77"], capsys) == (0, "RUNNING\n", "")


def test_run_of_asks_scontrol_through_the_runner_seam(home: Path, tmp_path: Path) -> None:
    record = JobRecord("5_1", "sbatch", "demo", str(tmp_path), "srun", 1, 1, str(tmp_path))
    save_record(replace(record, job_id="5", sweep_runs=("a", "b")))
    fake = FakeSlurm(scontrol=CommandResult(0, scontrol_line("5_1", "RUNNING"), ""))
    assert api.run_of("5_1", runner=fake) == api.RunOfJob("slurm-5_1", 0)
    assert fake.calls == [(["scontrol", "show", "job", "--oneliner", "5_1"], None)]
    assert api.run_of("6", runner=FakeSlurm()) is None  # no record: nothing asked


@pytest.mark.parametrize("digit", ["²", "３", "٣"])
def test_logs_skip_planted_files_numbered_in_another_scripts_digits(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str], digit: str
) -> None:
    """A file like ``77_²_log.out`` in a shared log folder is not a rank's: ``str.isdigit()``
    took ``²`` (``int()`` then raised) and ``int()`` read ``٣`` as rank 3."""
    for via, launch, good, planted in [
        ("submitit", "srun", "77_0_log.out", f"77_{digit}_log.out"),
        ("sbatch", "srun", "demo-77-rank0.out", f"demo-77-rank{digit}.out"),
        ("sbatch", "torchrun", "demo-77-node0.out", f"demo-77-node{digit}.out"),
    ]:
        logs = record_job(tmp_path, via=via, launch=launch)
        for old in logs.iterdir():
            old.unlink()
        (logs / good).write_text("[rank0]: mine\n")
        (logs / planted).write_text("[rank3]: planted\n")
        assert run(["logs", "77"], capsys) == (0, f"==> {logs / good} <==\n[rank0]: mine\n", "")
        _, out, err = run(["logs", "77", "--rank", "3"], capsys)
        assert "planted" not in out and "Traceback" not in err, (via, launch, out, err)


GOOD_RECORD = {
    "job_id": "77", "via": "sbatch", "name": "demo", "log_dir": "/tmp/logs", "launch": "srun",
    "nodes": 2, "procs_per_node": 2, "workdir": "/tmp",
}  # fmt: skip
BAD_RECORDS = {
    "deep": "[" * 100_000 + "]" * 100_000,
    "null-log-dir": json.dumps({**GOOD_RECORD, "log_dir": None}),
    "text-nodes": json.dumps({**GOOD_RECORD, "nodes": "x"}),
    "bool-nodes": json.dumps({**GOOD_RECORD, "nodes": True}),
    "number-name": json.dumps({**GOOD_RECORD, "name": 3}),
    "other-via": json.dumps({**GOOD_RECORD, "via": "evil"}),
    "runs-of-numbers": json.dumps({**GOOD_RECORD, "sweep_runs": [1, 2]}),
}


@pytest.mark.parametrize("text", BAD_RECORDS.values(), ids=list(BAD_RECORDS))
def test_a_damaged_job_record_is_the_one_line_error(
    home: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    """A record is ddpkit's own file, but a folder can be shared or a file damaged."""
    (home / "jobs").mkdir(parents=True)
    (home / "jobs" / "77.json").write_text(text)
    for command in (["logs", "77"], ["status", "77"], ["cancel", "77"]):
        code, out, err = run(command, capsys)
        assert (code, out) == (2, ""), (command, err[-500:])
        assert err.startswith("ddpkit: error: job record ") and err.count("\n") == 1, err[:500]
        assert len(err) < 1000 and "(hint: delete the file" in err
