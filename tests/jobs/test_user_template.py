"""A user's sbatch template extends ddpkit's base and cannot silently drop the stop-signal
protocol: one that does not extend it, overrides a block other than the documented ones, or
has a statement beside its blocks is refused (one line naming `template`, the file and the
hint; exit 2; nothing submitted). One that overrides an allowed block keeps the protocol."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.errors import ConfigError
from ddpkit.jobs import render
from ddpkit.jobs.spec import JobSpec
from ddpkit.jobs.user_template import USER_BLOCKS

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "src" / "ddpkit" / "templates"

# A complete script of its own (what a user copied from the docs before): no trap, no latch
# folder, no holder; SLURM's USR2 would kill the job instead of stopping it with a checkpoint.
DROPS = """#!/bin/bash
{% for key, value in sbatch_options %}
#SBATCH --{{ key }}{{ "" if value is none else "=" ~ value | sbatch_q }}
{% endfor %}
{% for key, value in exports %}
export {{ key }}={{ value | q }}
{% endfor %}
srun {{ python | q }} -u {{ command | map("q") | join(" ") }}
"""
# Allowed blocks only: a site's #SBATCH line, a module load, a container around the command.
ALLOWED = """{% extends launch_template %}
{% block sbatch_extra %}
#SBATCH --comment=site-template
{% endblock %}
{% block before_launch %}
echo "site: before the step"
{% endblock %}
{% block srun_options %}{{ super() }}--label {% endblock %}
{% block task_command %}env SITE=1 {{ super() }}{% endblock %}
{% block after_launch %}
echo "site: after the step"
{% endblock %}
"""
REFUSED = {
    "no-extends": (DROPS, "does not extend ddpkit's template"),
    "include": ('{% include "srun.sh.j2" %}', "does not extend ddpkit's template"),
    "other-file": ('{% extends "OTHER" %}', "does not extend ddpkit's template"),
    "protocol-block": (
        '{% extends "srun.sh.j2" %}\n{% block launch_prologue %}{% endblock %}',
        r"overrides the block 'launch_prologue' \(line 2\), which is ddpkit's own",
    ),
    "top-level-set": (
        "{% extends launch_template %}\n{% set signal = none %}",
        r"has a statement outside its blocks \(line 2\)",
    ),
}


def _spec(tmp_path: Path, source: str, **fields: Any) -> JobSpec:
    (tmp_path / "t.sh.j2").write_text(source)
    base = {"name": "u", "command": ["train.py"], "workdir": str(tmp_path), "nodes": 2}
    return JobSpec.model_validate({**base, "template": "t.sh.j2", **fields})


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_template_that_drops_the_protocol_is_refused(tmp_path: Path, case: str) -> None:
    source, problem = REFUSED[case]
    (tmp_path / "other.j2").write_text(DROPS)  # a file of the user's, not ddpkit's base
    source = source.replace("OTHER", str(tmp_path / "other.j2"))
    with pytest.raises(ConfigError, match=problem) as caught:
        render.render_sbatch(_spec(tmp_path, source))
    text = str(caught.value)
    assert f"template={str(tmp_path / 't.sh.j2')!r} " in text, text
    assert "stop-signal protocol (signal: USR2)" in text, text
    assert "extends launch_template" in caught.value.hint and "task_command" in caught.value.hint


def test_without_a_stop_signal_any_template_is_accepted(tmp_path: Path) -> None:
    assert render.render_sbatch(_spec(tmp_path, DROPS, signal=None)).startswith("#!/bin/bash\n")


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_an_allowed_override_keeps_the_protocol(tmp_path: Path, launch: str) -> None:
    mine = render.render_sbatch(_spec(tmp_path, ALLOWED, launch=launch))
    ours = render.render_sbatch(_spec(tmp_path, ALLOWED, launch=launch, template=None))
    added = {"#SBATCH --comment=site-template", 'echo "site: before the step"'}
    added.add('echo "site: after the step"')
    assert set(mine.splitlines()) - set(ours.splitlines()) - added == {
        line.replace(" --cpus-per-task=", " --label --cpus-per-task=").replace(
            " -m ddpkit.cluster.stop.hold ", " -m ddpkit.cluster.stop.hold env SITE=1 "
        )
        for line in ours.splitlines()
        if line.startswith("srun ")
    }
    for protocol in ("trap '", "DDPKIT_LATCH_DIR=", "-m ddpkit.cluster.stop.hold", "kill -USR2"):
        assert protocol in mine


def test_the_base_documents_exactly_the_blocks_a_user_may_override() -> None:
    base = (TEMPLATES / "base.sh.j2").read_text()
    defined = set(re.findall(r"{% block (\w+) %}", base))
    assert set(USER_BLOCKS) <= defined
    header = base[: base.index("#}")]
    listed = re.findall(r"^ {6}(\w+) {2,}", header, re.MULTILINE)
    assert listed == list(USER_BLOCKS), listed


def test_the_cli_refuses_it_with_exit_2_and_submits_nothing(tmp_path: Path) -> None:
    (tmp_path / "t.sh.j2").write_text(DROPS)
    (tmp_path / "job.yaml").write_text("name: demo\ncommand: train.py\ntemplate: t.sh.j2\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {bin_dir}/sbatch.called\necho 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env["DDPKIT_HOME"] = str(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "submit", "job.yaml"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith("ddpkit: error: template="), done.stderr
    assert done.stderr.count("\n") == 1 and "(hint: start it with" in done.stderr, done.stderr
    assert not (bin_dir / "sbatch.called").exists() and not (tmp_path / "home").exists()


def test_the_hints_signal_null_can_be_followed_in_a_spec_file(tmp_path: Path) -> None:
    """The refusal's hint says "or set signal: null", and the field's own doc says "null: none";
    in a spec file, null reset every field to its default, which for signal is USR2, so the
    advice could not be followed. Through the real command, as a user would."""
    (tmp_path / "t.sh.j2").write_text(DROPS)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: u\ncommand: train.py\ntemplate: t.sh.j2\nsignal: null\n")
    env = {**os.environ, "DDPKIT_HOME": str(tmp_path / "home")}
    for extra in ([], ["--set", "signal=USR1", "--set", "signal="]):
        done = subprocess.run(
            [sys.executable, "-m", "ddpkit", "submit", "--dry-run", str(spec), *extra],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        assert done.stdout.startswith("#!/bin/bash\n") and "--signal" not in done.stdout
