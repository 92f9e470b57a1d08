"""ddpkit.cluster.slurmtools: error paths through a fake Runner, then the real cluster (marker
``slurm``).

The fake answers each SLURM tool the way SLURM 22.05 does (texts copied from the real tools,
including a cluster without accounting, where sacct fails); the real-cluster tests submit tiny
scripts and check RUNNING -> COMPLETED, FAILED with its exit code, CANCELLED with nothing of the
job left on the nodes, array/heterogeneous ids, TIMEOUT (slow: SLURM's shortest limit is a minute)
and that with NETNS=1 one node's ``localhost`` is not another's.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from ddpkit.cluster import slurmtools as sl
from ddpkit.cluster.slurmtools import CommandResult, JobState, SlurmError
from ddpkit.errors import ConfigError
from slurm_cluster import SlurmCluster

NO_ACCOUNTING = "Slurm accounting storage is disabled\n"
INVALID_ID = "slurm_load_jobs error: Invalid job id specified\n"
OK = CommandResult(0, "", "")

Answer = CommandResult | Callable[[Sequence[str], str | None], CommandResult]


class FakeSlurm:
    """A Runner answering per tool (argv[0]), recording every call; other tools fail the test."""

    def __init__(self, **answers: Answer) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], str | None]] = []

    def __call__(
        self, argv: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        self.calls.append((list(argv), stdin))
        answer = self.answers.get(argv[0])
        if answer is None:
            pytest.fail(f"unexpected command {shlex.join(argv)}")
        return answer(argv, stdin) if callable(answer) else answer

    def tools(self) -> list[str]:
        return [argv[0] for argv, _ in self.calls]


def scontrol_line(job: str, state: str, exit_code: str = "0:0", extra: str = "") -> str:
    """One `scontrol show job --oneliner` line as SLURM 22.05 prints it (values with spaces too)."""
    return (
        f"JobId={job} JobName=my job name UserId=root(0) GroupId=root(0) {extra}Priority=1 "
        f"JobState={state} Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
        f"ExitCode={exit_code} RunTime=00:00:02 WorkDir=/tmp/a dir StdOut=/tmp/a dir/o.out\n"
    )


# ---------------------------------------------------------------- submit_script


def test_submit_script_sends_the_script_on_stdin_and_returns_the_id(tmp_path: Path) -> None:
    fake = FakeSlurm(sbatch=CommandResult(0, "4711\n", ""))
    assert sl.submit_script("#!/bin/bash\ntrue\n", cwd=tmp_path, runner=fake) == "4711"
    [(argv, stdin)] = fake.calls
    assert argv == ["sbatch", "--parsable", f"--chdir={tmp_path.resolve()}"]
    assert stdin == "#!/bin/bash\ntrue\n"


def test_submit_script_drops_the_cluster_name_and_warnings(tmp_path: Path) -> None:
    fake = FakeSlurm(sbatch=CommandResult(0, "12;lab\n", "sbatch: warning: something\n"))
    assert sl.submit_script("#!/bin/sh\n", cwd=tmp_path, runner=fake, extra_args=["-N2"]) == "12"
    assert fake.calls[0][0][-1] == "-N2"


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


# ---------------------------------------------------------------- cancel, wait, subprocess_runner


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


def test_wait_polls_until_finished() -> None:
    states = iter(["3|PENDING", "3|RUNNING", "3|COMPLETING"])
    fake = FakeSlurm(
        squeue=lambda argv, stdin: CommandResult(0, next(states, ""), ""),  # then: gone
        sacct=CommandResult(0, "3|COMPLETED|0:0\n", ""),
    )
    naps: list[float] = []
    status = sl.wait("3", 10, 0.5, runner=fake, clock=lambda: 0.0, sleep=naps.append)
    assert (status.state, status.source) == (JobState.COMPLETED, "sacct")
    assert naps == [0.5, 0.5, 0.5]


def test_wait_gives_up_after_timeout() -> None:
    now = [0.0]
    fake = FakeSlurm(squeue=CommandResult(0, "3|RUNNING\n", ""))

    def sleep(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(SlurmError, match=r"job 3 is still RUNNING after timeout_s=5") as caught:
        sl.wait("3", 5, 1, runner=fake, clock=lambda: now[0], sleep=sleep)
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


# ---------------------------------------------------------------- the real cluster


def without_accounting(
    argv: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
) -> CommandResult:
    """The real cluster, except that sacct fails as it does on a cluster without slurmdbd."""
    if argv[0] == "sacct":
        return CommandResult(1, "", NO_ACCOUNTING)
    return sl.subprocess_runner(argv, stdin=stdin, env=env)


RUNNERS = {"accounting": sl.subprocess_runner, "no-accounting": without_accounting}


def batch(out: Path, body: str, *sbatch: str) -> str:
    """A batch script writing to ``out`` with a 2-minute limit (a stuck test job cannot linger)."""
    options = "".join(f"#SBATCH {option}\n" for option in sbatch)
    return (
        f"#!/bin/bash\n#SBATCH --output={shlex.quote(str(out))}\n#SBATCH --time=2\n{options}"
        f"{body}\n"
    )


def settled(
    slurm: SlurmCluster, job: str, runner: sl.Runner = sl.subprocess_runner
) -> sl.JobStatus:
    """The job's status once accounting has caught up (sacct lags squeue by a second or two)."""
    deadline = time.monotonic() + 15
    status = sl.query_state(job, runner=runner, env=slurm.env)
    while slurm.accounting and runner is sl.subprocess_runner and status.source != "sacct":
        if time.monotonic() > deadline:
            pytest.fail(f"sacct never reported job {job}; last status {status}")
        time.sleep(0.2)
        status = sl.query_state(job, runner=runner, env=slurm.env)
    return status


@pytest.mark.slurm
@pytest.mark.parametrize("mode", sorted(RUNNERS))
def test_job_is_running_then_completed(slurm: SlurmCluster, tmp_path: Path, mode: str) -> None:
    runner = RUNNERS[mode]
    out, go = tmp_path / "job.out", tmp_path / "go"
    body = f"echo started\nwhile [ ! -e {shlex.quote(str(go))} ]; do sleep 0.1; done\necho done"
    job = slurm.track(sl.submit_script(batch(out, body), cwd=tmp_path, env=slurm.env))
    slurm.wait_for_text(out, "started")
    running = sl.query_state(job, runner=runner, env=slurm.env)
    assert (running.state, running.source) == (JobState.RUNNING, "squeue")
    go.touch()
    final = sl.wait(job, 60, 0.2, runner=runner, env=slurm.env)
    assert (final.state, final.exit_code) == (JobState.COMPLETED, 0), final
    assert final.source == ("scontrol" if mode == "no-accounting" else final.source)
    assert settled(slurm, job, runner).state is JobState.COMPLETED
    assert out.read_text() == "started\ndone\n"


@pytest.mark.slurm
def test_failing_job_is_failed_with_its_exit_code(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    job = slurm.track(sl.submit_script(batch(out, "exit 3"), cwd=tmp_path, env=slurm.env))
    final = sl.wait(job, 60, 0.2, env=slurm.env)
    assert (final.state, final.exit_code, final.raw) == (JobState.FAILED, 3, "FAILED"), final
    for runner in RUNNERS.values():
        status = settled(slurm, job, runner)
        assert (status.state, status.exit_code) == (JobState.FAILED, 3), status
    assert sl.query_state(job, runner=without_accounting, env=slurm.env).source == "scontrol"


@pytest.mark.slurm
def test_cancel_ends_every_process_of_the_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    marker = f"ddpkit-{uuid.uuid4().hex[:12]}"
    loop = "while :; do sleep 0.2; done"
    # a background child, one that ignores SIGTERM and is orphaned when the script dies, and a
    # step on both nodes whose task forks a SIGTERM-ignoring child of its own
    body = f"""
bash -c '{loop}' child-{marker} &
bash -c 'trap "" TERM; {loop}' orphan-{marker} &
srun bash -c '(trap "" TERM; {loop}) & {loop}' step-{marker} &
wait"""
    script = batch(tmp_path / "job.out", body, "--nodes=2")
    job = slurm.track(sl.submit_script(script, cwd=tmp_path, env=slurm.env))
    ours = lambda: [p for p in slurm.processes(marker) if "srun " not in p]  # noqa: E731
    deadline = time.monotonic() + 30
    while len(ours()) < 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(ours()) == 6, ours()
    try:
        sl.cancel(job, env=slurm.env)
        try:  # SIGKILL follows SIGTERM after KillWait (5 s); the job is COMPLETING until then
            final = sl.wait(job, 30, 0.2, env=slurm.env)
        except sl.SlurmError as exc:
            final = sl.JobStatus(JobState.UNKNOWN, str(exc), None, "none")
        left = slurm.processes(marker)
        assert left == [], f"left on the nodes after scancel (proctrack plugin?): {left}"
        assert final.state is JobState.CANCELLED, final
    finally:
        for line in slurm.processes(marker):
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
    assert settled(slurm, job).raw.startswith("CANCELLED")


@pytest.mark.slurm
def test_array_tasks_and_het_components_on_the_real_cluster(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    array = slurm.track(
        sl.submit_script(
            batch(tmp_path / "a-%a.out", "exit $SLURM_ARRAY_TASK_ID", "--array=0-1"),
            cwd=tmp_path,
            env=slurm.env,
        )
    )
    het = slurm.track(
        sl.submit_script(
            batch(tmp_path / "h.out", "true", "--ntasks=1", "hetjob", "--ntasks=1"),
            cwd=tmp_path,
            env=slurm.env,
        )
    )
    assert sl.wait(array, 60, 0.2, env=slurm.env).state is JobState.FAILED  # task 1 exits 1
    assert sl.wait(het, 60, 0.2, env=slurm.env).state is JobState.COMPLETED
    for runner in RUNNERS.values():
        task0, task1 = (settled(slurm, f"{array}_{task}", runner) for task in (0, 1))
        assert (task0.state, task0.exit_code) == (JobState.COMPLETED, 0), task0
        assert (task1.state, task1.exit_code) == (JobState.FAILED, 1), task1
        assert settled(slurm, f"{het}+1", runner).state is JobState.COMPLETED


@pytest.mark.slurm
def test_unknown_job_on_the_real_cluster(slurm: SlurmCluster) -> None:
    status = sl.query_state("987654321", env=slurm.env)
    assert (status.state, status.source) == (JobState.UNKNOWN, "none")
    assert "squeue not listed" in (status.hint or "")
    with pytest.raises(ConfigError, match="job_id='987654321' is not known to SLURM"):
        sl.cancel("987654321", env=slurm.env)


@pytest.mark.slurm
@pytest.mark.slow
def test_time_limit_gives_timeout(slurm: SlurmCluster, tmp_path: Path) -> None:
    # SLURM's shortest limit is one minute and slurmctld checks limits every 30 s: 60-90 s
    script = batch(tmp_path / "job.out", "sleep 300").replace("--time=2", "--time=1")
    job = slurm.track(sl.submit_script(script, cwd=tmp_path, env=slurm.env))
    final = sl.wait(job, 150, 1.0, env=slurm.env)
    assert final.state is JobState.TIMEOUT, final
    assert settled(slurm, job).state is JobState.TIMEOUT


PROBE = """
import os, socket, sys, time
port, first = int(sys.argv[1]), sys.argv[2]
if os.environ["SLURM_PROCID"] == "0":  # on the first node: serve until told "bye"
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(30)
        while True:
            conn, _ = server.accept()
            with conn:
                if conn.recv(3) == b"bye":
                    break
else:  # on the second node: the first node by name, then localhost
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((first, port), timeout=2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    try:
        socket.create_connection(("localhost", port), timeout=2).close()
        local = "reached"
    except OSError:
        local = "unreachable"
    with socket.create_connection((first, port), timeout=2) as conn:
        conn.sendall(b"bye")
    print(f"{socket.gethostname()} {first}:{port} reached, localhost:{port} {local}", flush=True)
"""


@pytest.mark.slurm
def test_netns_nodes_do_not_share_localhost(slurm: SlurmCluster, tmp_path: Path) -> None:
    if not slurm.netns:
        pytest.skip("the cluster runs without NETNS=1 (ci/test.sh starts it with NETNS=1)")
    (tmp_path / "probe.py").write_text(PROBE)
    body = (
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"srun {shlex.quote(sys.executable)} probe.py $((20000 + SLURM_JOB_ID % 20000)) $first"
    )
    out = tmp_path / "job.out"
    job = slurm.track(
        sl.submit_script(
            batch(out, body, "--nodes=2", "--ntasks-per-node=1"), cwd=tmp_path, env=slurm.env
        )
    )
    final = sl.wait(job, 60, 0.2, env=slurm.env)
    assert final.state is JobState.COMPLETED, out.read_text()
    assert out.read_text().split()[0::2] == ["n2", "reached,", "unreachable"], out.read_text()
