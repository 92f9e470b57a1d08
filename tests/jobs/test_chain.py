"""Job chains (``after``/``after_type``/``singleton``) and ``log_ranks``, without a cluster.

The spec refuses what cannot reach ``#SBATCH --dependency=`` safely; names resolve to job ids
through the records, then squeue/sacct (one Runner seam), and an unknown name stops the
submission before anything happens; each backend carries the chain or refuses it; ``ddpkit
status`` says why a job whose dependency failed never runs. The real-cluster counterpart is
tests/jobs/test_chain_cluster.py.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cli import main
from ddpkit.cluster.slurmtools import CommandResult, JobState, JobStatus
from ddpkit.errors import ConfigError
from ddpkit.jobs import chain, render
from ddpkit.jobs.backends.sbatch import waiting_explained
from ddpkit.jobs.backends.submitit import executor_parameters
from ddpkit.jobs.backends.torchx_appdef import refuse_sweep
from ddpkit.jobs.layout import format_plan
from ddpkit.jobs.records import JobRecord, save_record
from ddpkit.jobs.spec import JobSpec
from tests.fakes.slurm import FakeSlurm, FakeTools, scontrol_line
from tests.support.sbatch_parser import directive_arguments

BASE: dict[str, Any] = {"name": "b", "command": ["t.py"], "python": "/py", "workdir": "/w"}
NO_SLURM = FakeSlurm()  # any SLURM call fails the test


def spec(**fields: Any) -> JobSpec:
    return JobSpec(**(BASE | fields))


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeTools:
    """Stand-in sbatch/scontrol, and squeue/sacct that know no job: the machine's own SLURM
    tools (the lead's test cluster) are never reached."""
    fake = FakeTools(tmp_path / "bin", tmp_path / "calls")
    fake.sbatch("4242")
    fake.scontrol_jobs()
    fake.install("squeue", "#!/bin/sh\nexit 0\n")
    fake.install("sacct", "#!/bin/sh\nexit 0\n")
    monkeypatch.setenv("PATH", fake.path())
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FAKE_SCONTROL_JOB", raising=False)
    monkeypatch.chdir(tmp_path)
    return fake


def write_spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "b.yaml"
    path.write_text(f"name: b\ncommand: t.py\n{text}")
    return path


def record(job_id: str, name: str, home: Path, age_s: float = 0) -> None:
    done = JobRecord(job_id, "sbatch", name, "/l", "srun", 1, 1, "/w")
    save_record(replace(done, submitted_at=time.time() - age_s), home=home)


# ---- the spec --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("after", "ids"),
    [("prep", ["prep"]), (1234, ["1234"]), ([7, "pre.p-1_x", "12_3"], ["7", "pre.p-1_x", "12_3"])],
)
def test_after_takes_names_and_job_ids(after: object, ids: list[str]) -> None:
    assert spec(after=after).after == ids


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (
            "after: ['1;touch x']",
            "after=['1;touch x']: has '1;touch x', neither a SLURM job id nor a job name",
        ),
        ("after: ['7\\n#SBATCH --uid=0']", "neither a SLURM job id nor a job name"),
        ("after: [-x]", "after=['-x']: has '-x', neither"),
        ("after: ['afterok:1']", "after=['afterok:1']: has 'afterok:1', neither"),
        ("after: [12_x]", "after=['12_x']: has '12_x', neither"),
        ("after: ['1+0']", "after=['1+0']: has '1+0', neither"),
        ("after: [a, a]", "after=['a', 'a']: names 'a' twice"),
        ("after_type: afternotok", "after_type"),
        ("sbatch: {dependency: 'afterok:1'}", "sbatch.dependency: is set by ddpkit"),
        ("log_ranks: [0]", "log_ranks=[0]: is for launch: torchrun"),
        ("launch: torchrun\nlog_ranks: [1]", "log_ranks=[1]: has local rank 1, but a node runs 1"),
        ("launch: torchrun\nlog_ranks: []", "log_ranks=[]: is empty"),
    ],
)
def test_bad_chain_values_are_one_line_exit_2_and_nothing_is_submitted(
    tools: FakeTools, tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, words: str
) -> None:
    path = write_spec(tmp_path, line + "\n")
    assert main(["submit", str(path)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
    assert not tools.submitted()


def test_yaml_keeps_an_array_task_id_as_written(tmp_path: Path) -> None:
    from ddpkit.jobs.load import load_spec

    # YAML 1.1 reads 12_3 as 123: the chain would wait for another job
    assert load_spec(write_spec(tmp_path, "after: [12_3, 45]\n")).after == ["12_3", "45"]
    with pytest.raises(ConfigError, match="time_min='1_0': is not a whole number"):
        load_spec(write_spec(tmp_path, "time_min: 1_0\n"))


# ---- sbatch's --dependency -------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "option"),
    [
        ({"after": [1, "2_3"]}, "--dependency=afterok:1:2_3"),
        ({"after": [9], "after_type": "afterany"}, "--dependency=afterany:9"),
        ({"singleton": True}, "--dependency=singleton"),
        ({"after": [9], "singleton": True}, "--dependency=afterok:9,singleton"),
    ],
)
def test_the_script_has_one_dependency_option_sbatch_reads(
    fields: dict[str, Any], option: str
) -> None:
    script = render.render_sbatch(spec(**fields))
    assert [arg for arg in directive_arguments(script) if "dependency" in arg] == [option]


def test_no_chain_no_dependency_option() -> None:
    assert "dependency" not in render.render_sbatch(spec())


def test_a_name_left_in_after_is_never_rendered() -> None:
    with pytest.raises(ConfigError, match="job names are resolved to job ids at submission"):
        render.render_sbatch(spec(after=["prep"]))


def test_plan_says_what_the_chain_does() -> None:
    text = format_plan(spec(after=["prep", 5], singleton=True))
    assert "# chain: starts after prep, 5 (afterok: once every one has COMPLETED)" in text
    assert "# singleton: one job named b of yours runs at a time" in text
    assert "# chain" not in format_plan(spec())


# ---- names to job ids ------------------------------------------------------------------


def test_a_name_is_its_newest_recorded_job(tmp_path: Path) -> None:
    record("10", "prep", tmp_path, age_s=60)
    record("12", "prep", tmp_path)
    record("11", "other", tmp_path)
    local = JobRecord("x", "torchx", "prep", "/l", "srun", 1, 1, "/w", handle="local_cwd://t/x")
    save_record(replace(local, submitted_at=time.time() + 60), home=tmp_path)  # not on SLURM
    resolved = chain.resolve_after(spec(after=["prep", "5"]), runner=NO_SLURM, home=tmp_path)
    assert resolved.after == ["12", "5"]
    plain = spec(after=["5"])
    assert chain.resolve_after(plain, runner=NO_SLURM, home=tmp_path) is plain


def test_without_a_record_squeue_then_sacct_name_the_job(tmp_path: Path) -> None:
    fake = FakeSlurm(
        squeue=CommandResult(0, "", ""),
        sacct=CommandResult(0, "301\n300\n302_[1-2]\n302_0\nxx\n", ""),
    )
    resolved = chain.resolve_after(spec(after=["prep"]), runner=fake, home=tmp_path)
    assert resolved.after == ["302"]  # an array's tasks stand for the array
    assert fake.calls[0][0] == ["squeue", "--me", "--noheader", "--format=%i", "--name=prep"]
    assert fake.tools() == ["squeue", "sacct"]
    live = FakeSlurm(squeue=CommandResult(0, "400\n", ""))  # squeue answers: sacct not asked
    assert chain.resolve_after(spec(after=["prep"]), runner=live, home=tmp_path).after == ["400"]
    assert live.tools() == ["squeue"]


def test_an_unknown_name_stops_the_submission_before_anything_happens(
    tools: FakeTools, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["submit"], ["submit", "--dry-run"], ["submit", "--via", "submitit"]):
        assert main([*argv, str(write_spec(tmp_path, "after: [prep]\n"))]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ddpkit: error: after='prep': no job of that name in ddpkit's")
        assert err.count("\n") == 1
    assert not tools.submitted()
    assert not (tmp_path / "home").exists() and not (tmp_path / "ddpkit-logs").exists()


def test_submit_hands_sbatch_the_resolved_job_id(tools: FakeTools, tmp_path: Path) -> None:
    record("77", "prep", tmp_path / "home")
    assert main(["submit", str(write_spec(tmp_path, "after: [prep]\nsingleton: true\n"))]) == 0
    script = (tools.calls / "sbatch.stdin").read_text()
    assert "--dependency=afterok:77,singleton" in directive_arguments(script)


# ---- the other backends ----------------------------------------------------------------


def test_submitit_carries_the_dependency() -> None:
    extras = executor_parameters(spec(after=[3], singleton=True))["slurm_additional_parameters"]
    assert extras["dependency"] == "afterok:3,singleton"
    assert "dependency" not in executor_parameters(spec())["slurm_additional_parameters"]


@pytest.mark.parametrize(
    ("fields", "field"), [({"after": [3]}, "after=['3']"), ({"singleton": True}, "singleton=true")]
)
def test_torchx_refuses_a_chain_naming_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        refuse_sweep(spec(**fields))
    assert str(info.value).startswith(f"{field} cannot go through torchx")
    assert "--via sbatch" in str(info.value)
    refuse_sweep(spec())  # no chain: nothing refused


# ---- why a job never runs --------------------------------------------------------------


def pending(reason: str) -> FakeSlurm:
    line = scontrol_line("88", "PENDING").replace("Reason=None", f"Reason={reason}")
    return FakeSlurm(scontrol=CommandResult(0, line, ""))


def test_status_says_a_job_whose_dependency_failed_never_runs() -> None:
    waiting = JobStatus(JobState.PENDING, "PENDING", None, "squeue")
    told = waiting_explained(waiting, "88", runner=pending("DependencyNeverSatisfied"))
    assert told.state is JobState.PENDING
    assert told.hint is not None
    assert told.hint.startswith("job 88: SLURM's reason is DependencyNeverSatisfied: ")
    assert "will never start" in told.hint
    told = waiting_explained(waiting, "88", runner=pending("Dependency"))
    assert told.hint is not None and "waits for the jobs it depends on" in told.hint
    assert waiting_explained(waiting, "88", runner=pending("Priority")) == waiting
    running = JobStatus(JobState.RUNNING, "RUNNING", None, "squeue")
    assert waiting_explained(running, "88", runner=NO_SLURM) == running  # nothing asked


def test_ddpkit_status_prints_the_reason(
    tools: FakeTools, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tools.install("squeue", "#!/bin/sh\necho '88|PENDING'\n")
    line = scontrol_line("88", "PENDING").replace("Reason=None", "Reason=DependencyNeverSatisfied")
    monkeypatch.setenv("FAKE_SCONTROL_JOB", line)
    assert main(["status", "88"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("PENDING\n")
    assert err.startswith("ddpkit: job 88: SLURM's reason is DependencyNeverSatisfied: it waits")


# ---- log_ranks -------------------------------------------------------------------------


def test_log_ranks_becomes_torchruns_filter_on_the_ddpkit_run_line(tmp_path: Path) -> None:
    from tests.jobs.test_render import nul_list, run_script

    fields = {"python": sys.executable, "workdir": str(tmp_path), "after": [5]}
    job = spec(launch="torchrun", procs_per_node=4, log_ranks=[2, 0], **fields)
    assert job.log_ranks == [0, 2]
    argv = render.torchrun_command(job, endpoint="h:1", rdzv_id="9")
    assert argv[argv.index("--rdzv-id") + 2 :] == ["--local-ranks-filter", "0,2", "t.py"]
    assert "--local-ranks-filter" not in render.torchrun_command(replace_ranks(job))
    # the rendered script, run with stand-in srun: the node's `ddpkit run` gets the filter
    (call,) = run_script(render.render_sbatch(job), tmp_path)["srun"]
    words = nul_list(call / "argv")
    assert words[words.index("--local-ranks-filter") :] == ["--local-ranks-filter", "0,2", "t.py"]


def replace_ranks(job: JobSpec) -> JobSpec:
    return JobSpec(**(job.model_dump(exclude={"min_nodes"}) | {"log_ranks": None}))


def test_torchx_replicas_get_the_filter_too() -> None:
    pytest.importorskip("torchx")
    from ddpkit.jobs.backends.torchx_appdef import spec_to_appdef

    app = spec_to_appdef(spec(launch="torchrun", procs_per_node=2, log_ranks=[1]))
    words: Sequence[str] = app.roles[0].args
    assert "--local-ranks-filter 1 t.py" in words[1]


def test_after_and_singleton_flags_stand_for_the_fields(
    tools: FakeTools, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_spec(tmp_path, "after: [5]\n")
    # --after replaces the spec's list (it comes after any --set); values checked as any
    assert main(["submit", "--dry-run", str(path), "--after", "7", "--after", "8_1"]) == 0
    assert "--dependency=afterok:7:8_1" in directive_arguments(capsys.readouterr().out)
    assert main(["submit", "--dry-run", str(path), "--singleton"]) == 0
    assert "--dependency=afterok:5,singleton" in directive_arguments(capsys.readouterr().out)
    assert main(["submit", str(path), "--after", "7;x"]) == 2
    assert "after=['7;x']: has '7;x', neither" in capsys.readouterr().err
    assert not tools.submitted()
