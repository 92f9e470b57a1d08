"""ddpkit.cluster.slurmtools: error paths through the shared fake Runner (tests/fakes/slurm.py).

The fake answers each SLURM tool the way SLURM 22.05 does (texts copied from the real tools,
including a cluster without accounting, where sacct fails). The same calls on the real cluster
are tests/jobs/test_slurm_backend_cluster.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpkit.cluster import slurmtools as sl
from ddpkit.cluster.slurmtools import CommandResult, JobState, SlurmError
from ddpkit.errors import ConfigError
from tests.fakes.slurm import INVALID_ID, NO_ACCOUNTING, OK, FakeSlurm, scontrol_line

# ---------------------------------------------------------------- submit_script


def test_submit_script_sends_the_script_on_stdin_and_returns_the_id(tmp_path: Path) -> None:
    fake = FakeSlurm(sbatch=CommandResult(0, "4711\n", ""))
    assert sl.submit_script("#!/bin/bash\ntrue\n", cwd=tmp_path, runner=fake) == "4711"
    [(argv, stdin)] = fake.calls
    assert argv == ["sbatch", "--parsable", f"--chdir={tmp_path.resolve()}"]
    assert stdin == "#!/bin/bash\ntrue\n"


def test_submit_script_drops_the_cluster_name_and_warnings(tmp_path: Path) -> None:
    fake = FakeSlurm(sbatch=CommandResult(0, "12;lab\n", "sbatch: warning: something\n"))
    assert sl.submit_script("#!/bin/sh\n", cwd=tmp_path, runner=fake) == "12"


def test_submit_script_failure_names_the_command_and_sbatch_message(tmp_path: Path) -> None:
    message = "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
    fake = FakeSlurm(sbatch=CommandResult(1, "", message))
    with pytest.raises(SlurmError) as caught:
        sl.submit_script("#!/bin/sh\n", cwd=tmp_path, runner=fake)
    text = str(caught.value)
    assert f"`sbatch --parsable --chdir={tmp_path.resolve()}` failed with exit code 1" in text
    assert "Invalid partition name specified" in text
    assert caught.value.hint is not None


def test_submit_script_rejects_output_that_is_not_a_job_id(tmp_path: Path) -> None:
    fake = FakeSlurm(sbatch=CommandResult(0, "Submitted batch job 5\n", ""))
    with pytest.raises(SlurmError, match="printed 'Submitted batch job 5\\\\n', not a job id"):
        sl.submit_script("#!/bin/sh\n", cwd=tmp_path, runner=fake)


def test_submit_script_checks_cwd_before_calling_sbatch(tmp_path: Path) -> None:
    fake = FakeSlurm()
    with pytest.raises(ConfigError, match=r"cwd='.*missing' is not a directory"):
        sl.submit_script("#!/bin/sh\n", cwd=tmp_path / "missing", runner=fake)
    assert fake.calls == []


# ---------------------------------------------------------------- query_state


def test_live_job_comes_from_squeue_alone() -> None:
    fake = FakeSlurm(squeue=CommandResult(0, "7|RUNNING\n", ""))
    status = sl.query_state(7, runner=fake)
    assert (status.state, status.raw, status.exit_code, status.source) == (
        JobState.RUNNING, "RUNNING", None, "squeue",
    )  # fmt: skip
    assert fake.tools() == ["squeue"]
    argv = fake.calls[0][0]
    assert argv[argv.index("--jobs") + 1] == "7"


def test_finished_job_comes_from_sacct_with_exit_code_and_signal() -> None:
    fake = FakeSlurm(squeue=OK, sacct=CommandResult(0, "7|CANCELLED by 0|0:15\n", ""))
    status = sl.query_state("7", runner=fake)
    assert (status.state, status.raw, status.exit_code, status.signal, status.source) == (
        JobState.CANCELLED, "CANCELLED by 0", 0, 15, "sacct",
    )  # fmt: skip
    assert fake.tools() == ["squeue", "sacct"]


def test_without_accounting_scontrol_answers() -> None:
    fake = FakeSlurm(
        squeue=CommandResult(1, "", INVALID_ID),
        sacct=CommandResult(1, "", NO_ACCOUNTING),
        scontrol=CommandResult(0, scontrol_line("7", "FAILED", "3:0"), ""),
    )
    status = sl.query_state("7", runner=fake)
    assert (status.state, status.exit_code, status.signal, status.source) == (
        JobState.FAILED, 3, 0, "scontrol",
    )  # fmt: skip
    assert fake.tools() == ["squeue", "sacct", "scontrol"]


def test_sacct_lagging_behind_squeue_is_overruled_by_scontrol() -> None:
    fake = FakeSlurm(
        squeue=OK,
        sacct=CommandResult(0, "7|RUNNING|0:0\n", ""),
        scontrol=CommandResult(0, scontrol_line("7", "COMPLETED"), ""),
    )
    status = sl.query_state("7", runner=fake)
    assert (status.state, status.source) == (JobState.COMPLETED, "scontrol")


def test_sacct_answers_when_scontrol_has_forgotten_the_job() -> None:
    fake = FakeSlurm(
        squeue=OK,
        sacct=CommandResult(0, "7|RUNNING|0:0\n", ""),
        scontrol=CommandResult(1, "", INVALID_ID),
    )
    assert sl.query_state("7", runner=fake).source == "sacct"


def test_unknown_job_is_unknown_with_every_tools_reason() -> None:
    fake = FakeSlurm(
        squeue=CommandResult(1, "", INVALID_ID),
        sacct=CommandResult(1, "", NO_ACCOUNTING),
        scontrol=CommandResult(1, "", INVALID_ID),
    )
    status = sl.query_state("99", runner=fake)
    assert (status.state, status.source, status.raw, status.exit_code) == (
        JobState.UNKNOWN, "none", "", None,
    )  # fmt: skip
    assert status.hint is not None
    assert "job 99: squeue not listed; sacct failed: Slurm accounting storage is disabled" in (
        status.hint
    )
    assert "scontrol forgotten or never known" in status.hint
    assert "MinJobAge" in status.hint


def test_controller_down_is_reported_in_the_hint() -> None:
    down = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"
    fake = FakeSlurm(
        squeue=CommandResult(1, "", down),
        sacct=CommandResult(0, "", ""),
        scontrol=CommandResult(1, "", down),
    )
    hint = sl.query_state("5", runner=fake).hint or ""
    assert "squeue failed: slurm_load_jobs error: Unable to contact slurm controller" in hint
    assert "sacct no record" in hint


def test_invalid_id_is_refused_before_any_command() -> None:
    fake = FakeSlurm()
    with pytest.raises(ConfigError, match="job_id='12; rm -rf /' is not a SLURM job id"):
        sl.query_state("12; rm -rf /", runner=fake)
    assert fake.calls == []


ARRAY = "9_[3-5]|PENDING\n9_1|RUNNING\n9_2|COMPLETING\n"


@pytest.mark.parametrize(
    ("job_id", "squeue_out", "state"),
    [
        ("9", ARRAY, JobState.RUNNING),  # pending tasks are listed first; one runs
        ("9_2", ARRAY, JobState.COMPLETING),
        ("9_4", ARRAY, JobState.PENDING),  # inside the pending range
        ("9_7", "9_[1-9:2,20%4]|PENDING\n", JobState.PENDING),  # step 2, throttle 4
        ("5+1", "5+0|PENDING\n5+1|RUNNING\n", JobState.RUNNING),  # squeue lists both
        ("5", "5+0|PENDING\n5+1|PENDING\n", JobState.PENDING),
        ("12", "9_3|RUNNING\n", JobState.RUNNING),  # the raw id of an array task
    ],
)
def test_arrays_and_heterogeneous_jobs_in_squeue(
    job_id: str, squeue_out: str, state: JobState
) -> None:
    status = sl.query_state(job_id, runner=FakeSlurm(squeue=CommandResult(0, squeue_out, "")))
    assert (status.state, status.raw, status.source) == (state, state.value, "squeue")


@pytest.mark.parametrize("job_id", ["9_6", "9_8", "10", "5+2"])
def test_rows_of_other_tasks_do_not_answer(job_id: str) -> None:
    fake = FakeSlurm(
        squeue=CommandResult(0, "9_[1-5:2]|PENDING\n9_7|RUNNING\n5+0|RUNNING\n", ""),
        sacct=OK,
        scontrol=CommandResult(1, "", INVALID_ID),
    )
    assert sl.query_state(job_id, runner=fake).state is JobState.UNKNOWN


@pytest.mark.parametrize(
    ("job_id", "sacct_out", "state", "exit_code"),
    [
        ("4", "4_1|COMPLETED|0:0\n4_2|FAILED|2:0\n4_3|COMPLETED|0:0\n", JobState.FAILED, 2),
        ("4", "4_1|COMPLETED|0:0\n4_2|COMPLETED|0:0\n", JobState.COMPLETED, 0),
        ("4_3", "4_3|TIMEOUT|0:0\n", JobState.TIMEOUT, 0),
        ("6+1", "6+0|COMPLETED|0:0\n6+1|OUT_OF_MEMORY|0:125\n", JobState.OUT_OF_MEMORY, 0),
    ],
)
def test_arrays_and_heterogeneous_jobs_in_sacct(
    job_id: str, sacct_out: str, state: JobState, exit_code: int
) -> None:
    fake = FakeSlurm(squeue=OK, sacct=CommandResult(0, sacct_out, ""))
    status = sl.query_state(job_id, runner=fake)
    assert (status.state, status.exit_code, status.source) == (state, exit_code, "sacct")


def test_scontrol_shows_array_tasks_and_het_components_by_their_ids() -> None:
    lines = scontrol_line("8", "COMPLETED", extra="ArrayJobId=4 ArrayTaskId=2 ") + scontrol_line(
        "6", "FAILED", "1:0", extra="HetJobId=5 HetJobOffset=1 "
    )
    fake = FakeSlurm(squeue=OK, sacct=CommandResult(1, "", NO_ACCOUNTING))
    fake.answers["scontrol"] = CommandResult(0, lines, "")
    assert sl.query_state("4_2", runner=fake).state is JobState.COMPLETED
    failed = sl.query_state("5+1", runner=fake)
    assert (failed.state, failed.exit_code) == (JobState.FAILED, 1)


# ------------------------------------------------- cancel, poll_until_finished, subprocess_runner


def test_cancel_runs_verbose_scancel() -> None:
    fake = FakeSlurm(scancel=CommandResult(0, "", "scancel: Terminating job 7\n"))
    sl.cancel("7", runner=fake)
    assert fake.calls == [(["scancel", "--verbose", "7"], None)]


def test_cancel_of_an_unknown_job_is_an_error_although_scancel_exits_0() -> None:
    said = "scancel: error: Kill job error on job id 99: Invalid job id specified\n"
    fake = FakeSlurm(scancel=CommandResult(0, "", "scancel: Terminating job 99\n" + said))
    with pytest.raises(ConfigError, match="job_id='99' is not known to SLURM") as caught:
        sl.cancel(99, runner=fake)
    assert "MinJobAge" in (caught.value.hint or "")


def test_cancel_of_a_finished_job_is_quietly_done() -> None:
    said = "scancel: error: Kill job error on job id 7: Job/step already completing or completed\n"
    sl.cancel("7", runner=FakeSlurm(scancel=CommandResult(0, "", said)))


def test_cancel_failure_is_an_error() -> None:
    down = "scancel: error: Unable to contact slurm controller (connect failure)\n"
    with pytest.raises(SlurmError, match="`scancel --verbose 7` failed with exit code 1: scancel"):
        sl.cancel("7", runner=FakeSlurm(scancel=CommandResult(1, "", down)))


def test_poll_until_finished_polls_until_finished() -> None:
    states = iter(["3|PENDING", "3|RUNNING", "3|COMPLETING"])
    fake = FakeSlurm(
        squeue=lambda argv, stdin: CommandResult(0, next(states, ""), ""),  # then: gone
        sacct=CommandResult(0, "3|COMPLETED|0:0\n", ""),
    )
    naps: list[float] = []
    status = sl.poll_until_finished(
        lambda: sl.query_state("3", runner=fake), "3", 10, 0.5, clock=lambda: 0.0, sleep=naps.append
    )
    assert (status.state, status.source) == (JobState.COMPLETED, "sacct")
    assert naps == [0.5, 0.5, 0.5]


def test_poll_until_finished_gives_up_after_timeout() -> None:
    now = [0.0]
    fake = FakeSlurm(squeue=CommandResult(0, "3|RUNNING\n", ""))

    def sleep(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(SlurmError, match=r"job 3 is still RUNNING after timeout_s=5") as caught:
        sl.poll_until_finished(
            lambda: sl.query_state("3", runner=fake), "3", 5, 1, clock=lambda: now[0], sleep=sleep
        )
    assert "ddpkit cancel 3" in (caught.value.hint or "")
    assert now[0] == 5


def test_subprocess_runner_passes_stdin_and_env() -> None:
    env = {"PATH": os.environ["PATH"], "DDPKIT_PROBE": "x y"}
    done = sl.subprocess_runner(
        ["sh", "-c", 'cat; echo "$DDPKIT_PROBE" >&2; exit 3'], stdin="in", env=env
    )
    assert done == CommandResult(3, "in", "x y\n")


def test_subprocess_runner_missing_tool_is_a_slurm_error() -> None:
    with pytest.raises(SlurmError, match="command 'ddpkit-no-such-sbatch' not found") as caught:
        sl.subprocess_runner(["ddpkit-no-such-sbatch", "--parsable"])
    assert "slurm-client" in (caught.value.hint or "")
