"""``snapshot: true``: the files git tracks under ``workdir`` are copied at submission and the
job runs from the copy (:mod:`ddpkit.jobs.snapshot`). Here with a stand-in ``sbatch``; on the
real cluster (an edit after submit, attempts 0 and 1) in test_snapshot_cluster.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ddpkit.cli import main
from ddpkit.errors import ConfigError
from ddpkit.jobs.backends.submitit import executor_parameters
from ddpkit.jobs.backends.torchx_appdef import refuse_sweep
from ddpkit.jobs.spec import JobSpec
from tests.fakes.slurm import FakeTools
from tests.support.sbatch_parser import directive_arguments


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeTools:
    """Stand-in sbatch (job 4242), nothing else of SLURM; the test's folder as cwd."""
    fake = FakeTools(tmp_path / "bin", tmp_path / "calls")
    fake.sbatch("4242")
    monkeypatch.setenv("PATH", fake.path())
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return fake


def repository(root: Path) -> Path:
    """A git repository under ``root``: the job's folder ``work`` with tracked files (one in a
    subfolder, a symbolic link) and an untracked one; nothing committed (git tracks the index)."""
    work = root / "work"
    (work / "pkg").mkdir(parents=True)
    (work / "train.py").write_text("print('as submitted')\n")
    (work / "pkg" / "mod.py").write_text("X = 1\n")
    (work / "link.py").symlink_to("train.py")
    (work / "untracked.txt").write_text("not in git\n")
    (root / "outside.py").write_text("above the workdir\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(
        ["git", "-C", str(root), "add", "work/train.py", "work/pkg/mod.py", "work/link.py",
         "outside.py"],
        check=True,
    )  # fmt: skip
    return work


def spec_file(work: Path, extra: str = "") -> Path:
    path = work.parent / "job.yaml"
    path.write_text(f"name: exp\ncommand: train.py\nworkdir: {work}\nsnapshot: true\n{extra}")
    return path


def snapshots(work: Path) -> list[Path]:
    folder = work / "ddpkit-logs" / "snapshots"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_the_job_runs_from_a_copy_of_the_tracked_files(tools: FakeTools, tmp_path: Path) -> None:
    work = repository(tmp_path)
    assert main(["submit", str(spec_file(work))]) == 0
    (work / "train.py").write_text("print('edited after submit')\n")  # the copy keeps its text
    (copy,) = snapshots(work)
    assert copy.name.startswith("exp-")
    found = sorted(str(p.relative_to(copy)) for p in copy.rglob("*"))
    assert found == ["link.py", "pkg", "pkg/mod.py", "train.py"]  # tracked, under workdir only
    assert (copy / "train.py").read_text() == "print('as submitted')\n"
    assert os.readlink(copy / "link.py") == "train.py"
    script = (tools.calls / "sbatch.stdin").read_text()
    assert f"--chdir={copy}" in directive_arguments(script)
    assert f"cd -- {copy}\n" in script  # each attempt's shell starts in the copy: requeues too
    # the logs stay where they were: log_dir is made absolute against the original workdir
    assert f"--output={work}/ddpkit-logs/exp-%j.out" in directive_arguments(script)


def test_dry_run_and_plan_say_where_and_copy_nothing(
    tools: FakeTools, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = repository(tmp_path)
    assert main(["submit", "--dry-run", str(spec_file(work))]) == 0
    shown = capsys.readouterr().out
    assert f"--chdir={work}/ddpkit-logs/snapshots/exp-" in shown
    assert snapshots(work) == [] and not tools.submitted()
    assert main(["plan", str(spec_file(work))]) == 0
    plan = capsys.readouterr().out
    assert f"# snapshot: the files git tracks under {work} are copied to " in plan


def test_a_workdir_outside_git_is_one_line_and_nothing_is_submitted(
    tools: FakeTools, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "plain"
    work.mkdir()
    (work / "train.py").write_text("print(1)\n")
    assert main(["submit", str(spec_file(work))]) == 2
    err = capsys.readouterr().err
    assert f"snapshot=true: workdir {work} is not in a git repository" in err
    assert "set snapshot: false" in err and len(err.strip().splitlines()) == 1
    assert not tools.submitted() and snapshots(work) == []


def test_a_failed_submission_leaves_no_copy(
    tools: FakeTools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = repository(tmp_path)
    monkeypatch.setenv("FAKE_SBATCH_FAIL", "sbatch: error: invalid partition")
    assert main(["submit", str(spec_file(work))]) != 0
    assert not (work / "ddpkit-logs").exists()  # neither the copy nor the folders it needed


def test_off_by_default_and_the_other_backends_refuse_it(tmp_path: Path) -> None:
    base = {"name": "b", "command": ["t.py"], "python": "/py", "workdir": "/w"}
    assert JobSpec(**base).snapshot is False
    job = JobSpec(**base, snapshot=True)
    for refuse in (executor_parameters, refuse_sweep):
        with pytest.raises(ConfigError) as info:
            refuse(job)
        assert str(info.value).startswith("snapshot=true copies the files for ddpkit's sbatch")
        assert "--via sbatch" in str(info.value)


def test_the_command_line_turns_it_on_for_one_submission(tools: FakeTools, tmp_path: Path) -> None:
    work = repository(tmp_path)
    path = spec_file(work)
    path.write_text(path.read_text().replace("snapshot: true\n", ""))
    assert main(["submit", str(path)]) == 0
    assert snapshots(work) == []  # off by default
    assert main(["submit", str(path), "--set", "snapshot=true"]) == 0
    (copy,) = snapshots(work)
    assert (copy / "train.py").is_file()
