"""``--via torchx`` carries the spec's account, qos and ``sbatch:`` options, or refuses them.

torchx 0.7's slurm scheduler has run options for partition, time and constraint only; ddpkit's
role adds the rest to each node's ``#SBATCH`` group (torchx's ``Role.pre_proc`` hook) and
quotes every value there for sbatch's parser. Dry runs are read back with ``sbatch_parser``;
the real cluster's account and QOS are tests/jobs/test_torchx_sbatch_cluster.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpkit.cli import main
from tests.support import needs
from tests.support.sbatch_parser import HETJOB, directive_arguments

needs.module("torchx")

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = ROOT / "tests" / "scripts" / "report_rank.py"
HOSTILE = 'x\\\' --export=ALL,DDPKIT_INJECTED=1 #"y"'


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    # no sinfo: torchx's dry run would ask it for the partition's memory
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_spec(directory: Path, fields: str, args: str = "") -> Path:
    path = directory / "job.yaml"
    path.write_text(f"name: demo\ncommand: {PAYLOAD} {args}\ntime_min: 5\nnodes: 2\n{fields}")
    return path


def dry_run(spec: Path, capsys: pytest.CaptureFixture[str], scheduler: str) -> tuple[int, str]:
    argv = ["submit", str(spec), "--via", "torchx", "--scheduler", scheduler, "--dry-run"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0 or not out, out
    return code, out if code == 0 else err


def groups(script: str) -> list[dict[str, str | None]]:
    """Each het component's options, as sbatch reads the script."""
    found: list[dict[str, str | None]] = [{}]
    for argument in directive_arguments(script[script.index("#!/bin/bash") :]):
        if argument == HETJOB:
            found.append({})
            continue
        assert argument.startswith("--"), argument
        key, sep, value = argument[2:].partition("=")
        assert key not in found[-1], f"--{key} twice: {script}"
        found[-1][key] = value if sep else None
    return found


def test_slurm_dry_run_shows_account_qos_and_sbatch_options_in_every_group(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quoted = json.dumps(HOSTILE)  # a YAML double-quoted string
    spec = write_spec(
        workdir,
        f"account: proj-1\nqos: high\npartition: {quoted}\n"
        f"sbatch: {{exclusive: true, overcommit: false, comment: {quoted}, gres: 'gpu:2'}}\n",
    )
    code, out = dry_run(spec, capsys, "slurm")
    assert code == 0, out
    found = groups(out)
    assert len(found) == 2  # one het component per node
    for k, group in enumerate(found):
        assert group["job-name"] == f"demo-{k}"
        assert (group["account"], group["qos"]) == ("proj-1", "high")
        assert (group["comment"], group["partition"]) == (HOSTILE, HOSTILE)  # one value each
        assert ("exclusive", None) in group.items() and "overcommit" not in group
        assert group["gres"] == "gpu:2"
        assert "export" not in group


def test_local_cwd_dry_run_names_the_slurm_options_it_does_not_use(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(workdir, "account: proj-1\nqos: high\nsbatch: {exclusive: true}\n")
    code, out = dry_run(spec, capsys, "local_cwd")
    assert code == 0, out
    assert "# not used by local_cwd (SLURM options): account, qos, sbatch.exclusive\n" in out


@pytest.mark.parametrize("key", ["nodelist", "gpus", "nodefile"])
def test_whole_job_sbatch_options_are_refused_naming_via_sbatch(
    workdir: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    spec = write_spec(workdir, f"sbatch: {{{key}: 'n[1-2]'}}\n")
    for scheduler in ("slurm", "local_cwd"):
        code, err = dry_run(spec, capsys, scheduler)
        assert code == 2
        assert err.startswith(f"ddpkit: error: sbatch.{key}='n[1-2]' cannot go through torchx")
        assert "--via sbatch" in err and err.count("\n") == 1
    assert main(["submit", str(spec), "--via", "torchx", "--scheduler", "slurm"]) == 2
    assert sorted(p.name for p in workdir.iterdir()) == ["job.yaml"]  # nothing submitted
