"""The ``slurm`` fixture: a handle on the real test cluster that ``ci/slurm-up`` starts.

``ci/test.sh`` brings the cluster up and exports ``DDPKIT_TEST_SLURM_ENV`` (the env file it wrote;
default ``$DDPKIT_SLURM_DIR/env.sh``, ``/tmp/ddpkit-slurm/env.sh``). Without a cluster that
answers, a test using the fixture FAILS under ``CI=true`` and is skipped (saying why) elsewhere.
Tests using it must be marked ``@pytest.mark.slurm`` (checked), so ``-m slurm`` finds them all.

The handle never touches ``os.environ``: ``slurm.env`` is the environment to hand to SLURM's
clients (``subprocess.run(..., env=slurm.env)``,
``ddpkit.cluster.slurmtools.query_state(..., env=...)``).
Its helpers talk to SLURM directly, independent of ``ddpkit.jobs``, so they can judge it; jobs it
submitted or was told about with :meth:`SlurmCluster.track` are cancelled after each test.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.needs import missing

__all__ = ["ABSENT", "FINISHED", "SlurmCluster", "slurm", "slurm_cluster"]

ABSENT = "SLURM cluster not running: ci/test.sh starts it with ci/slurm-up"
# scontrol's JobState once a job is over and its processes are gone (COMPLETING is shown until then)
FINISHED = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE",
})  # fmt: skip


class SlurmCluster:
    """The running test cluster: its client environment plus submit/wait/inspect helpers."""

    def __init__(self, env: dict[str, str], info: dict[str, Any]) -> None:
        self.env = env
        self.info = info
        self.submitted: list[str] = []

    @property
    def netns(self) -> bool:
        """True when every node has its own network namespace (``localhost`` is per node)."""
        return bool(self.info.get("netns", False))

    @property
    def accounting(self) -> bool:
        return bool(self.info.get("accounting", False))

    def run(
        self, *argv: str, stdin: str | None = None, check: bool = True, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run a command with the cluster's environment; ``check`` fails the test on exit != 0."""
        done = subprocess.run(
            list(argv),
            input=stdin,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if check and done.returncode != 0:
            pytest.fail(f"`{shlex.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, script: str, *, cwd: Path, args: tuple[str, ...] = ()) -> str:
        """Submit ``script`` (text) with plain ``sbatch --parsable``; the job id (tracked)."""
        done = self.run("sbatch", "--parsable", f"--chdir={cwd}", *args, stdin=script)
        return self.track(done.stdout.strip().split(";")[0])

    def track(self, job_id: str) -> str:
        """Remember a job submitted by other means, so the fixture cancels it after the test."""
        self.submitted.append(job_id)
        return job_id

    def submit_spec(self, spec: Path, *, home: Path, via: str | None = None) -> str:
        """``ddpkit submit SPEC`` (from the spec's folder, with its own DDPKIT_HOME), the job
        tracked for cleanup; its id. Fails the test with ddpkit's stderr when it exits != 0."""
        argv = [sys.executable, "-m", "ddpkit", "submit", str(spec)]
        done = subprocess.run(
            [*argv, "--via", via] if via else argv,
            env={**self.env, "DDPKIT_HOME": str(home)}, cwd=spec.parent,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return self.track(done.stdout.strip())

    def state(self, job_id: str) -> str:
        """``scontrol``'s JobState (COMPLETING while processes are still exiting), or ''."""
        done = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False)
        for field in done.stdout.split():
            if field.startswith("JobState="):
                return field.removeprefix("JobState=")
        return ""

    def wait(self, job_id: str, timeout_s: float = 60, states: frozenset[str] = FINISHED) -> str:
        """Poll ``scontrol`` until the job reaches one of ``states``; that state."""
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in states:
                if state in FINISHED and self.accounting:
                    self._sacct_settled(job_id, max(30.0, deadline - time.monotonic()))
                return state
            time.sleep(0.2)
        pytest.fail(f"job {job_id} still {state or 'unknown'} after {timeout_s} s, not {states}")

    def _sacct_settled(self, job_id: str, timeout_s: float) -> None:
        """Until sacct, which lags scontrol, has recorded the end of every run of the job (no
        run still RUNNING, PENDING or REQUEUED there), so that a test reading its history sees
        what scontrol saw; bounded: the test's own assertion then shows what sacct holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = self.run(
                "sacct", "-j", job_id, "--duplicates", "-n", "-P", "-X", "-o", "JobID,State",
                check=False,
            )  # fmt: skip
            last: dict[str, str] = {}  # each job's (array task's) newest run, oldest first
            for line in done.stdout.splitlines():
                job, _, state = line.partition("|")
                if state.strip():
                    last[job] = state.split()[0]
            active = {"RUNNING", "PENDING", "REQUEUED", "COMPLETING"}
            if last and not set(last.values()) & active:
                return
            time.sleep(0.5)

    def wait_for_text(self, path: Path, text: str, timeout_s: float = 60) -> str:
        """Poll a job's output file until it contains ``text``; the file's content."""
        deadline = time.monotonic() + timeout_s
        content = ""
        while time.monotonic() < deadline:
            content = path.read_text(errors="replace") if path.exists() else ""
            if text in content:
                return content
            time.sleep(0.1)
        pytest.fail(f"{path} has no {text!r} after {timeout_s} s; it holds: {content!r}")

    def processes(self, marker: str) -> list[str]:
        """Command lines of every process on this machine (all nodes) containing ``marker``."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                raw = (proc / "cmdline").read_bytes()
            except OSError:  # exited while we looked
                continue
            cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            if marker in cmdline:
                found.append(f"{proc.name}: {cmdline}")
        return found

    def cancel_tracked(self) -> None:
        live = [job for job in self.submitted if self.state(job) not in FINISHED | {""}]
        if live:
            self.run("scancel", *live, check=False)


def _env_file() -> Path:
    default = Path(os.environ.get("DDPKIT_SLURM_DIR", "/tmp/ddpkit-slurm"), "env.sh")
    return Path(os.environ.get("DDPKIT_TEST_SLURM_ENV", default))


def _read_env_file(path: Path) -> dict[str, str]:
    """``export KEY=VALUE`` lines (shell-quoted values) of an env file ci/slurm-up wrote."""
    variables = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, _, value = words[1].partition("=")
            variables[key] = value
    return variables


def _connect() -> tuple[SlurmCluster | None, str]:
    """The cluster named by the env file, or None and why it is not usable."""
    path = _env_file()
    if not path.is_file():
        return None, f"no env file {path} (DDPKIT_TEST_SLURM_ENV)"
    env = {**os.environ, **_read_env_file(path)}
    info_path = path.with_name("cluster.json")
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    cluster = SlurmCluster(env, info)
    try:
        ping = cluster.run("scontrol", "ping", check=False, timeout_s=20)
        nodes = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout_s=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"SLURM's clients do not answer: {exc}"
    if "is UP" not in ping.stdout:
        return None, f"slurmctld of {env.get('SLURM_CONF')} is not up: {ping.stdout}{ping.stderr}"
    states = dict(line.split() for line in nodes.stdout.splitlines() if len(line.split()) == 2)
    bad = {node: state for node, state in states.items() if state.rstrip("*~#") not in _USABLE}
    if not states or bad:
        return None, f"nodes not usable: {bad or nodes.stderr.strip() or 'none listed'}"
    return cluster, ""


# "planned": idle nodes the backfill scheduler has set aside for a pending job (Slurm 23.02+); a
# worker that connects while another worker's job waits for them sees it (CI, stop 53).
_USABLE = {"idle", "mixed", "allocated", "completing", "planned"}


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """Session-wide: find the cluster once; fail under CI=true, skip elsewhere, when absent."""
    cluster, why = _connect()
    if cluster is None:
        missing(f"{ABSENT} ({why})")
    return cluster


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster, request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """Per test: a handle sharing the cluster's environment; its jobs are cancelled afterwards."""
    if request.node.get_closest_marker("slurm") is None:
        pytest.fail(f"{request.node.nodeid} uses the slurm fixture: mark it @pytest.mark.slurm")
    handle = SlurmCluster(slurm_cluster.env, slurm_cluster.info)
    yield handle
    handle.cancel_tracked()
