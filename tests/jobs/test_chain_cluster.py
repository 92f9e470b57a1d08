"""Job chains on the real SLURM cluster of ``ci/slurm-up`` (marker ``slurm``).

Job B with ``after: [A]`` (afterok) starts only once A has completed; when A fails, B never
runs and ``ddpkit status B`` says why (SLURM's reason DependencyNeverSatisfied). The jobs are
torch-free stubs (:data:`STUB_A`, :data:`STUB_B`, written per test): a few Python lines each,
so the 2-core machine barely notices them. Order is shown by causes, not clocks: A writes
``a-done`` as its last act, and B writes whether it saw that file when it started.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

GUARD_S = 90  # a hang guard, not a timing assertion

# A: says it started, waits for the test's go (file "release"; a guard against a hang), writes
# a-done as its last act and exits with the code it was given.
STUB_A = """\
import pathlib, sys, time
here = pathlib.Path(sys.argv[1])
(here / "a-started").write_text("yes")
deadline = time.monotonic() + 60
while not (here / "release").exists() and time.monotonic() < deadline:
    time.sleep(0.2)
(here / "a-done").write_text("yes")
sys.exit(int(sys.argv[2]))
"""
# B: records whether A had finished when B started.
STUB_B = """\
import pathlib, sys
here = pathlib.Path(sys.argv[1])
(here / "b-ran").write_text(f"saw a-done: {(here / 'a-done').exists()}")
"""


class Chain:
    """Two stub jobs in ``folder``, submitted with ``ddpkit submit`` and a private home."""

    def __init__(self, slurm: SlurmCluster, folder: Path) -> None:
        self.slurm, self.folder, self.home = slurm, folder, folder / "home"
        (folder / "a.py").write_text(STUB_A)
        (folder / "b.py").write_text(STUB_B)

    def submit(self, name: str, command: str, fields: str = "") -> str:
        spec = self.folder / f"{name}.yaml"
        spec.write_text(
            f"name: {name}\ncommand: {command}\npython: {sys.executable}\ntime_min: 5\n"
            f"max_requeues: 0\n{fields}"
        )
        return self.slurm.submit_spec(spec, home=self.home)

    def ddpkit(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ddpkit", *args],
            env={**self.slurm.env, "DDPKIT_HOME": str(self.home)}, cwd=self.folder,
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    def reason(self, job: str) -> str:
        done = self.slurm.run("scontrol", "show", "job", "--oneliner", job, check=False)
        fields = dict(word.partition("=")[::2] for word in done.stdout.split() if "=" in word)
        return fields.get("Reason", "")

    def wait_reason(self, job: str, reason: str) -> None:
        """Until the scheduler has given ``job`` the reason (it sets it on its next pass)."""
        deadline = time.monotonic() + GUARD_S
        while self.reason(job) != reason and time.monotonic() < deadline:
            time.sleep(0.5)
        assert self.reason(job) == reason, f"job {job}: {self.slurm.state(job)}"


def test_b_starts_only_after_a_completes(slurm: SlurmCluster, tmp_path: Path) -> None:
    chain = Chain(slurm, tmp_path)
    a = chain.submit("chain-a", f"a.py {tmp_path} 0")
    b = chain.submit("chain-b", f"b.py {tmp_path}", "after: [chain-a]\n")  # by name: the record
    slurm.wait(a, GUARD_S, frozenset({"RUNNING"}))
    slurm.wait_for_text(tmp_path / "a-started", "yes", GUARD_S)
    chain.wait_reason(b, "Dependency")
    assert slurm.state(b) == "PENDING"
    status = chain.ddpkit("status", b)
    assert status.returncode == 0 and status.stdout.startswith("PENDING")
    assert "waits for the jobs it depends on" in status.stderr, status.stderr
    assert not (tmp_path / "b-ran").exists()
    (tmp_path / "release").write_text("go")
    assert slurm.wait(a, GUARD_S) == "COMPLETED"
    assert slurm.wait(b, GUARD_S) == "COMPLETED"
    assert (tmp_path / "b-ran").read_text() == "saw a-done: True"


def test_when_a_fails_b_never_runs_and_status_says_why(slurm: SlurmCluster, tmp_path: Path) -> None:
    chain = Chain(slurm, tmp_path)
    (tmp_path / "release").write_text("go")  # A fails at once
    a = chain.submit("chain-a", f"a.py {tmp_path} 3")
    b = chain.submit("chain-b", f"b.py {tmp_path}", f"after: [{a}]\n")  # by job id
    assert slurm.wait(a, GUARD_S) == "FAILED"
    # SLURM keeps B pending with this reason (or, with kill_invalid_depend, cancels it)
    chain.wait_reason(b, "DependencyNeverSatisfied")
    assert slurm.state(b) in ("PENDING", "CANCELLED")
    status = chain.ddpkit("status", b)
    assert status.returncode == 0, status.stderr
    assert status.stdout.split()[0] in ("PENDING", "CANCELLED")
    assert f"job {b}: SLURM's reason is DependencyNeverSatisfied" in status.stderr
    assert "will never start" in status.stderr
    assert not (tmp_path / "b-ran").exists()


def test_singleton_waits_for_the_running_job_of_its_name(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    chain = Chain(slurm, tmp_path)
    first = chain.submit("chain-one", f"a.py {tmp_path} 0", "singleton: true\n")
    slurm.wait(first, GUARD_S, frozenset({"RUNNING"}))
    second = chain.submit("chain-one", f"b.py {tmp_path}", "singleton: true\n")
    chain.wait_reason(second, "Dependency")
    assert slurm.state(second) == "PENDING"
    assert not (tmp_path / "b-ran").exists()
    (tmp_path / "release").write_text("go")
    assert slurm.wait(second, GUARD_S) == "COMPLETED"
    assert (tmp_path / "b-ran").read_text() == "saw a-done: True"
