"""Which profile file a spec's ``profile: NAME`` uses, through ``ddpkit plan|submit``.

A profile's ``setup:`` lines run in the job, so the choice must not depend on the folder one
stands in: a name found as two files is an error naming both (``ddpkit.jobs.profiles``), one
found once is used and named (plan: a comment line; submit, dry run or not: stderr), and a path
chooses one file explicitly. SLURM's sbatch is a fake here that records whether it was called.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.cli import main
from ddpkit.jobs.load import load_spec
from ddpkit.jobs.render import render_sbatch
from tests.fakes.slurm import FakeTools


class Places:
    """The folders a profile name is looked up in, for one test: a spec folder, a (shared)
    working directory, and the user's own config folder (XDG, or DDPKIT_HOME when set)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.specs = root / "project"
        self.cwd = root / "shared-scratch"
        self.xdg = root / "xdg"
        self.home = root / "ddpkit-home"
        for folder in (self.specs, self.cwd, self.xdg):
            folder.mkdir(parents=True, exist_ok=True)
        self.tools = FakeTools(root / "bin")
        self.tools.sbatch()
        self.bin = self.tools.bin
        self.spec = self.specs / "job.yaml"
        self.spec.write_text("name: demo\ncommand: train.py\nprofile: site\n")

    def profile(self, folder: Path, partition: str, ext: str = ".yaml") -> Path:
        path = folder / "profiles" / f"site{ext}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"partition: {partition}\nsetup: ['echo {partition}-setup']\n")
        return path

    @property
    def user_dir(self) -> Path:
        return self.xdg / "ddpkit"

    @property
    def submitted(self) -> bool:
        return self.tools.submitted()


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Places:
    found = Places(tmp_path)
    monkeypatch.chdir(found.cwd)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(found.xdg))
    monkeypatch.setenv("HOME", str(tmp_path / "no-such-home"))
    monkeypatch.delenv("DDPKIT_HOME", raising=False)
    monkeypatch.setenv("PATH", found.tools.path())
    return found


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code: int, out: str, err: str, places: Places, *paths: Path) -> None:
    assert (code, out) == (2, ""), err
    assert err.startswith("ddpkit: error: ") and err.count("\n") == 1, err
    assert f"profile='site' is defined in {len(paths)} places: " in err
    for path in paths:
        assert str(path) in err
    assert "name the file you mean" in err
    assert not places.submitted


# --- one file: used, and named ------------------------------------------------------------


@pytest.mark.parametrize("where", ["spec dir", "cwd", "xdg", "ddpkit home", "home config"])
def test_a_profile_found_once_is_used_and_plan_names_its_file(
    places: Places,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    if where == "ddpkit home":
        monkeypatch.setenv("DDPKIT_HOME", str(places.home))
    if where == "home config":  # neither XDG_CONFIG_HOME nor DDPKIT_HOME: ~/.config/ddpkit
        monkeypatch.delenv("XDG_CONFIG_HOME")
        monkeypatch.setenv("HOME", str(places.root / "user"))
    folder = {
        "spec dir": places.specs,
        "cwd": places.cwd,
        "xdg": places.user_dir,
        "ddpkit home": places.home,
        "home config": places.root / "user" / ".config" / "ddpkit",
    }[where]
    path = places.profile(folder, "p1")
    code, out, err = run(capsys, "plan", str(places.spec))
    assert (code, err) == (0, "")
    assert out.startswith(f"# resolved job spec\n# profile 'site' read from {path}\n")
    assert "partition: p1" in out


def test_dry_run_and_submit_name_the_profile_file_on_stderr(
    places: Places, capsys: pytest.CaptureFixture[str]
) -> None:
    path = places.profile(places.user_dir, "mine")
    code, out, err = run(capsys, "submit", str(places.spec), "--dry-run")
    assert code == 0
    assert out == render_sbatch(load_spec(places.spec))  # stdout: the script, exactly
    assert "echo mine-setup" in out
    assert err == f"ddpkit: profile 'site' read from {path}\n"
    assert not places.submitted
    code, out, err = run(capsys, "submit", str(places.spec))
    assert (code, out) == (0, "4242\n")
    assert err == f"ddpkit: profile 'site' read from {path}\n"
    assert "echo mine-setup" in (places.bin / "sbatch.stdin").read_text()


# --- two files: refused, naming both -------------------------------------------------------


def test_a_profiles_folder_in_the_working_directory_does_not_shadow_the_users_own(
    places: Places, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = places.profile(places.user_dir, "mine")
    planted = places.profile(places.cwd, "planted")
    for argv in (["plan"], ["submit", "--dry-run"], ["submit"]):
        code, out, err = run(capsys, *argv, str(places.spec))
        assert_refused(code, out, err, places, planted, mine)
        assert "planted-setup" not in out


def test_the_spec_folder_and_the_users_own_are_refused_too(
    places: Places, capsys: pytest.CaptureFixture[str]
) -> None:
    shipped = places.profile(places.specs, "shipped")
    mine = places.profile(places.user_dir, "mine")
    code, out, err = run(capsys, "plan", str(places.spec))
    assert_refused(code, out, err, places, shipped, mine)


def test_yaml_and_yml_in_one_folder_are_two_files(
    places: Places, capsys: pytest.CaptureFixture[str]
) -> None:
    first = places.profile(places.user_dir, "a", ".yaml")
    second = places.profile(places.user_dir, "b", ".yml")
    code, out, err = run(capsys, "plan", str(places.spec))
    assert_refused(code, out, err, places, first, second)


def test_a_path_chooses_one_of_them(places: Places, capsys: pytest.CaptureFixture[str]) -> None:
    mine = places.profile(places.user_dir, "mine")
    places.profile(places.cwd, "planted")
    code, out, err = run(capsys, "plan", str(places.spec), "--set", f"profile={mine}")
    assert (code, err) == (0, "")
    assert f"# profile {str(mine)!r} read from {mine}\n" in out and "partition: mine" in out
    places.spec.write_text(f"name: demo\ncommand: train.py\nprofile: {mine}\n")
    code, out, err = run(capsys, "submit", "--dry-run", str(places.spec))
    assert code == 0 and "echo mine-setup" in out and "planted" not in out
    assert err == f"ddpkit: profile {str(mine)!r} read from {mine}\n"


def test_the_same_file_reached_twice_is_one_file(
    places: Places, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = places.profile(places.specs, "p")
    monkeypatch.chdir(places.specs)  # the spec folder is the working directory
    code, out, _ = run(capsys, "plan", str(places.spec))
    assert code == 0 and f"read from {path}\n" in out
    (places.cwd / "profiles").symlink_to(places.specs / "profiles")  # a linked folder
    monkeypatch.chdir(places.cwd)
    code, out, _ = run(capsys, "plan", str(places.spec))
    assert code == 0 and "partition: p" in out


def test_without_a_profile_nothing_is_said(
    places: Places, capsys: pytest.CaptureFixture[str]
) -> None:
    places.spec.write_text("name: demo\ncommand: train.py\n")
    places.profile(places.cwd, "unused")
    code, out, err = run(capsys, "plan", str(places.spec))
    assert (code, err) == (0, "") and "# profile" not in out
    code, out, err = run(capsys, "submit", "--dry-run", str(places.spec))
    assert (code, err) == (0, "")


def test_the_real_command_refuses_a_shadowing_profile(tmp_path: Path) -> None:
    """The headline case end to end: the ``ddpkit`` executable, its own environment."""
    places = Places(tmp_path)
    mine = places.profile(places.user_dir, "mine")
    planted = places.profile(places.cwd, "planted")
    env = {
        **os.environ,
        "XDG_CONFIG_HOME": str(places.xdg),
        "PATH": f"{places.bin}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("DDPKIT_HOME", None)
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "submit", str(places.spec)],
        cwd=places.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert_refused(done.returncode, done.stdout, done.stderr, places, planted, mine)
    assert "Traceback" not in done.stderr
