"""Every backend's ``#SBATCH`` lines mean, to sbatch's own parser, exactly the spec's values.

The generated text of each path (sbatch template, submitit, torchx's slurm scheduler) is read
back with ``sbatch_parser`` (a port of SLURM 22.05's directive parser) for values an attacker
or a careless copy could put in a spec: quotes, a backslash before a quote (which used to end
submitit's quoted word and add an sbatch option of its own), whitespace, ``#``, shell syntax.
The real cluster reads the same values in tests/jobs/test_sbatch_quoting_cluster.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit import compat
from ddpkit.errors import ConfigError
from ddpkit.jobs.backends import submitit as submitit_backend
from ddpkit.jobs.render import render_sbatch, sbatch_options
from ddpkit.jobs.spec import JobSpec
from tests.fakes.slurm import FakeTools
from tests.support.sbatch_parser import HETJOB, SbatchFatal, directive_arguments

# The first one is the attack: sbatch, reading submitit's shlex quoting, ended the comment at
# the space and took --export=... as an option of its own.
HOSTILE = [
    "a\\'\" --export=ALL,LD_PRELOAD=/tmp/evil.so #",
    "x\\' --hold '",
    "back\\slash",
    "trailing\\",
    "\\\\two",
    "it's",
    'say "hi"',
    "two words",
    "tab\there",
    "#hash",
    "a #b",
    "$(touch /tmp/pwned); `id`",
    "hetjob",
    "x hetjob y",
    ":colon",
    "--export=ALL",
    "ünïcödé 日本",
]


def spec_with(tmp_path: Path, value: str, **fields: object) -> JobSpec:
    """A small job whose comment and account are ``value``."""
    return JobSpec(
        name="quoting",
        command=["train.py"],
        nodes=2,
        workdir=str(tmp_path),
        account=value,
        sbatch={"comment": value, "exclusive": True},
        **fields,
    )


def options(arguments: list[str]) -> dict[str, str | None]:
    """``--key=value`` arguments as a mapping; every argument must be one long option."""
    found: dict[str, str | None] = {}
    for argument in arguments:
        assert argument.startswith("--"), f"not an option of ours: {argument!r} in {arguments}"
        key, sep, value = argument[2:].partition("=")
        assert key not in found, f"--{key} twice in {arguments}"
        found[key] = value if sep else None
    return found


@pytest.mark.parametrize("value", HOSTILE)
def test_sbatch_template_lines_read_back_as_written(tmp_path: Path, value: str) -> None:
    spec = spec_with(tmp_path, value)
    expected = [f"--{k}" if v is None else f"--{k}={v}" for k, v in sbatch_options(spec)]
    assert directive_arguments(render_sbatch(spec)) == expected


@pytest.fixture
def fake_srun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit renders its script only where ``srun`` is on PATH; this one does nothing."""
    tools = FakeTools(tmp_path / "bin")
    tools.srun()
    monkeypatch.setenv("PATH", tools.path())


def submitit_options(spec: JobSpec) -> dict[str, str | None]:
    text = compat.submitit_sbatch_text(submitit_backend.make_executor(spec))
    return options(directive_arguments(text))


@pytest.mark.usefixtures("fake_srun")
@pytest.mark.parametrize("value", HOSTILE)
def test_submitit_lines_read_back_as_written(tmp_path: Path, value: str) -> None:
    found = submitit_options(spec_with(tmp_path, value))
    plain = submitit_options(spec_with(tmp_path, "plain"))
    assert found.keys() == plain.keys()  # no option added, none lost
    assert (found["comment"], found["account"], found["exclusive"]) == (value, value, None)
    assert found["chdir"] == str(tmp_path)


@pytest.mark.usefixtures("fake_srun")
def test_submitit_paths_with_quotes_read_back_and_a_backslash_is_refused(tmp_path: Path) -> None:
    odd = tmp_path / 'it\'s a "dir" #1'
    found = submitit_options(spec_with(odd, "plain"))
    assert found["chdir"] == str(odd)
    assert found["output"] == f"{odd}/ddpkit-logs/%j_0_log.out"
    for field, spec in [
        ("workdir", spec_with(tmp_path / "a\\b", "plain")),
        ("log_dir", spec_with(tmp_path, "plain", log_dir="logs\\x")),
    ]:
        with pytest.raises(ConfigError, match=f"{field}=.*contains a backslash") as caught:
            submitit_backend.make_executor(spec)
        assert "%j" in (caught.value.hint or "")


def test_the_parser_port_reads_like_sbatch() -> None:
    """The port's own rules, as observed on SLURM 22.05.8 (scontrol shows the comment)."""
    read = directive_arguments
    assert read("#SBATCH --comment='a\\'\"'\"'\" --export=ALL,X=1 #'\n") == [
        "--comment=a'\"'",  # what submitit's quoting of the first HOSTILE value became
        "--export=ALL,X=1",
    ]
    assert read('#SBATCH --comment="a\\\\b" --x\n#SBATCH  --y # z\necho\n#SBATCH --no') == [
        "--comment=a\\b",
        "--x",
        "--y",
    ]
    assert read("#SBATCH --a=1\n#SBATCH hetjob\n#SBATCH --b=2 hetjob --c\n") == [
        "--a=1",
        HETJOB,
        "--b=2",
    ]
    with pytest.raises(SbatchFatal, match="Unmatched"):
        read("#SBATCH --comment='a\n")
