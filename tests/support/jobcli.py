"""``ddpkit submit`` of a spec that must be refused, in this process, with a fake sbatch."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.cli import main
from tests.fakes.slurm import FakeTools


def submit_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    line: str,
) -> str:
    """Submit ``name``, ``command`` and ``line`` (YAML) with a fake sbatch first on PATH; assert
    the refusal bad input gets (exit 2, one line with a hint, nothing submitted, no record) and
    return that line."""
    fake = FakeTools(tmp_path / "bin", tmp_path / "calls")
    fake.sbatch("4242")
    monkeypatch.setenv("PATH", fake.path())
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "job.yaml"
    path.write_text(f"name: job\ncommand: t.py\n{line}\n")
    assert main(["submit", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddpkit: error: ") and err.count("\n") == 1, err
    assert "(hint: " in err, err
    assert not fake.submitted()
    assert not (tmp_path / "home").exists(), "a job record was written"
    return err
