"""ddpkit.cluster.slurmtools on the real cluster (marker ``slurm``): tiny scripts, real tools.

RUNNING -> COMPLETED (with and without accounting), FAILED with its exit code, CANCELLED with
nothing of the job left on the nodes, array/heterogeneous ids, TIMEOUT (slow: SLURM's shortest
limit is a minute) and that with NETNS=1 one node's ``localhost`` is not another's. The error
paths through the shared fake Runner are tests/jobs/test_slurm_backend.py.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from ddpkit.cluster import slurmtools as sl
from ddpkit.cluster.slurmtools import CommandResult, JobState
from ddpkit.errors import ConfigError
from tests.fakes.slurm import NO_ACCOUNTING
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm


# ---------------------------------------------------------------- the real cluster


def without_accounting(
    argv: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
) -> CommandResult:
    """The real cluster, except that sacct fails as it does on a cluster without slurmdbd."""
    if argv[0] == "sacct":
        return CommandResult(1, "", NO_ACCOUNTING)
    return sl.subprocess_runner(argv, stdin=stdin, env=env)


RUNNERS = {"accounting": sl.subprocess_runner, "no-accounting": without_accounting}


def _wait(
    job: str,
    timeout_s: float,
    poll_s: float,
    *,
    runner: sl.Runner = sl.subprocess_runner,
    env: Mapping[str, str] | None = None,
) -> sl.JobStatus:
    """The job's final status, polled as the backends poll it."""
    return sl.poll_until_finished(
        lambda: sl.query_state(job, runner=runner, env=env), job, timeout_s, poll_s
    )


@pytest.fixture(scope="module", autouse=True)
def timed_out(
    slurm_cluster: SlurmCluster,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[str]:
    """The time-limit job, submitted before this module's first test and judged by its last:
    SLURM's shortest limit is one minute and slurmctld checks limits every 30 s, so it ends
    60-90 s after its start; the module's other tests run meanwhile instead of before. Not
    submitted when that test is not selected (``-m "not slow"``, ``-k``)."""
    judged = f"{__name__.rpartition('.')[2]}.py::{test_time_limit_gives_timeout.__name__}"
    if not any(item.nodeid.endswith(judged) for item in request.session.items):
        yield ""
        return
    where = tmp_path_factory.mktemp("timeout")
    script = batch(where / "job.out", "sleep 300").replace("--time=2", "--time=1")
    job = sl.submit_script(script, cwd=where, env=slurm_cluster.env)
    try:
        yield job
    finally:
        slurm_cluster.run("scancel", job, check=False)


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
    final = _wait(job, 60, 0.2, runner=runner, env=slurm.env)
    assert (final.state, final.exit_code) == (JobState.COMPLETED, 0), final
    assert final.source == ("scontrol" if mode == "no-accounting" else final.source)
    assert settled(slurm, job, runner).state is JobState.COMPLETED
    assert out.read_text() == "started\ndone\n"


def test_failing_job_is_failed_with_its_exit_code(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    job = slurm.track(sl.submit_script(batch(out, "exit 3"), cwd=tmp_path, env=slurm.env))
    final = _wait(job, 60, 0.2, env=slurm.env)
    assert (final.state, final.exit_code, final.raw) == (JobState.FAILED, 3, "FAILED"), final
    for runner in RUNNERS.values():
        status = settled(slurm, job, runner)
        assert (status.state, status.exit_code) == (JobState.FAILED, 3), status
    assert sl.query_state(job, runner=without_accounting, env=slurm.env).source == "scontrol"


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
    # 6 in two reads in a row: between fork and exec, a loop's `sleep` still shows its bash's
    # command line, marker included (a 7th seen once in CI)
    deadline = time.monotonic() + 30
    seen = [ours(), ours()]
    while [len(found) for found in seen[-2:]] != [6, 6] and time.monotonic() < deadline:
        time.sleep(0.2)
        seen.append(ours())
    assert [len(found) for found in seen[-2:]] == [6, 6], seen[-2:]
    try:
        sl.cancel(job, env=slurm.env)
        try:  # SIGKILL follows SIGTERM after KillWait (5 s); the job is COMPLETING until then
            final = _wait(job, 30, 0.2, env=slurm.env)
        except sl.SlurmError as exc:
            final = sl.JobStatus(JobState.UNKNOWN, str(exc), None, "none")
        left = slurm.processes(marker)
        assert left == [], f"left on the nodes after scancel (proctrack plugin?): {left}"
        assert final.state is JobState.CANCELLED, final
    finally:
        for line in slurm.processes(marker):
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
    assert settled(slurm, job).raw.startswith("CANCELLED")


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
    assert _wait(array, 60, 0.2, env=slurm.env).state is JobState.FAILED  # task 1 exits 1
    assert _wait(het, 60, 0.2, env=slurm.env).state is JobState.COMPLETED
    for runner in RUNNERS.values():
        task0, task1 = (settled(slurm, f"{array}_{task}", runner) for task in (0, 1))
        assert (task0.state, task0.exit_code) == (JobState.COMPLETED, 0), task0
        assert (task1.state, task1.exit_code) == (JobState.FAILED, 1), task1
        assert settled(slurm, f"{het}+1", runner).state is JobState.COMPLETED


def test_unknown_job_on_the_real_cluster(slurm: SlurmCluster) -> None:
    status = sl.query_state("987654321", env=slurm.env)
    assert (status.state, status.source) == (JobState.UNKNOWN, "none")
    assert "squeue not listed" in (status.hint or "")
    with pytest.raises(ConfigError, match="job_id='987654321' is not known to SLURM"):
        sl.cancel("987654321", env=slurm.env)


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
            batch(out, body, "--nodes=2", "--nodelist=n[1-2]", "--ntasks-per-node=1"),
            cwd=tmp_path,
            env=slurm.env,
        )
    )
    final = _wait(job, 60, 0.2, env=slurm.env)
    assert final.state is JobState.COMPLETED, out.read_text()
    assert out.read_text().split()[0::2] == ["n2", "reached,", "unreachable"], out.read_text()


@pytest.mark.slow
def test_time_limit_gives_timeout(slurm: SlurmCluster, timed_out: str) -> None:
    # the module's last test: its job was submitted before the first (the fixture)
    final = _wait(timed_out, 150, 1.0, env=slurm.env)
    assert final.state is JobState.TIMEOUT, final
    assert settled(slurm, timed_out).state is JobState.TIMEOUT
