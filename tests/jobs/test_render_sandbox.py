"""A user's sbatch template renders in Jinja2's sandbox: it cannot run code or read the
environment of the machine that previews or submits it, through the real ``ddpkit`` command.

Each payload below runs a command (it touches a marker file) or prints an environment variable
with a plain ``jinja2.Environment``; in the sandbox it is a one-line error naming the template
file, exit 2, and nothing reaches sbatch: one real command a mode, every payload through the
CLI's entry function in the test's process. ddpkit's own templates are unchanged by the sandbox
(tests/jobs/test_render.py compares them with the golden files).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cli import main
from ddpkit.errors import ConfigError
from ddpkit.jobs import render
from ddpkit.jobs.spec import JobSpec
from tests.fakes.slurm import FakeTools

SECRET = "sandbox-secret-4f2a9c"
MARK = "MARKER"

# Each would run `touch MARKER` (or print $DDPKIT_TEST_SECRET) on the previewing machine today.
PAYLOADS = {
    "cycler-globals": "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "subclasses": (
        "{% for c in ''.__class__.__mro__[1].__subclasses__() %}"
        "{% if c.__name__ == '_wrap_close' %}{{ c.__init__.__globals__['system']('touch MARKER') }}"
        "{% endif %}{% endfor %}"
    ),
    "lipsum-globals": "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "self-builtins": (
        "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}"
    ),
    "spec-default-factory": (
        "{{ spec.model_fields.python.default_factory.__globals__.sys.modules.os"
        ".system('touch MARKER') }}"
    ),
    "format-string-environ": (
        "{{ '{0.model_fields[python].default_factory.__globals__[os].environ}'.format(spec) }}"
    ),
    "attr-filter-environ": (
        "{{ joiner|attr('__init__')|attr('__globals__')|attr('__getitem__')('os')"
        "|attr('environ') }}"
    ),
    "namespace-environ": "{{ namespace.__init__.__globals__.os.environ['DDPKIT_TEST_SECRET'] }}",
    "mutate-spec": "{{ spec.env.update({'INJECTED': 'x'}) }}{{ spec.env }}",
}


def _env(tmp_path: Path) -> dict[str, str]:
    """A fake sbatch first on PATH, ddpkit's home in ``tmp_path``, a secret set."""
    tools = FakeTools(tmp_path / "bin")
    tools.sbatch()
    return {
        "PATH": tools.path(),
        "DDPKIT_HOME": str(tmp_path / "home"),
        "DDPKIT_TEST_SECRET": SECRET,
    }


def ddpkit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real command, in ``tmp_path``, with :func:`_env`."""
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *args],
        cwd=tmp_path,
        env={**os.environ, **_env(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def ddpkit_here(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``ddpkit_here(tmp_path, *args)``: as :func:`ddpkit`, through ``ddpkit.cli.main`` in this
    process (the variations of a case that one real command per mode covers end to end)."""

    def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
        for name, value in _env(tmp_path).items():
            monkeypatch.setenv(name, value)
        monkeypatch.chdir(tmp_path)
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["ddpkit", *args], code, out, err)

    return run


# every way a spec's template is rendered: previewed, submitted, submitted as a sweep (array)
MODES = {"dry-run": ["--dry-run"], "submit": [], "sweep": ["--sweep", "lr=1,2"]}


def _refused(tmp_path: Path, payload: str, mode: str, ddpkit: Callable[..., Any]) -> None:
    template = tmp_path / "evil.sbatch.j2"
    template.write_text("#!/bin/bash\n# a harmless first line\n" + payload + "\n")
    spec = tmp_path / "job.yaml"
    spec.write_text("name: demo\ncommand: train.py --lr {lr}\ntemplate: evil.sbatch.j2\n")
    done = ddpkit(tmp_path, "submit", str(spec), *MODES[mode])
    assert not (tmp_path / MARK).exists(), "the template ran a command"
    assert SECRET not in done.stdout + done.stderr, "the template read the environment"
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith("ddpkit: error: sbatch template "), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{template}, line 3: " in done.stderr
    assert "sandbox" in done.stderr and "(hint: " in done.stderr
    assert not FakeTools(tmp_path / "bin").submitted(), "sbatch was called"
    assert not (tmp_path / "home").exists(), "a job record was written"


@pytest.mark.parametrize("mode", list(MODES))
def test_a_template_escape_is_refused_through_the_real_command(tmp_path: Path, mode: str) -> None:
    _refused(tmp_path, PAYLOADS["subclasses"], mode, ddpkit)


# the spec-default-factory payload reads spec.model_fields, which pydantic deprecates (a real
# command does not show a DeprecationWarning; pytest does)
_MODEL_FIELDS_WARNING = "ignore:Accessing the 'model_fields' attribute on the instance"


@pytest.mark.filterwarnings(_MODEL_FIELDS_WARNING)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=list(PAYLOADS))
def test_template_escapes_are_refused_through_the_cli(
    tmp_path: Path, payload: str, mode: str, ddpkit_here: Callable[..., Any]
) -> None:
    _refused(tmp_path, payload, mode, ddpkit_here)


@pytest.mark.filterwarnings(_MODEL_FIELDS_WARNING)
@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=list(PAYLOADS))
def test_plan_never_renders_the_template(
    tmp_path: Path, payload: str, ddpkit_here: Callable[..., Any]
) -> None:
    """plan shows the resolved spec and its ranks: the template is not rendered there."""
    (tmp_path / "evil.sbatch.j2").write_text("#!/bin/bash\n" + payload + "\n")
    spec = tmp_path / "job.yaml"
    spec.write_text("name: demo\ncommand: train.py\ntemplate: evil.sbatch.j2\n")
    done = ddpkit_here(tmp_path, "plan", str(spec))
    assert not (tmp_path / MARK).exists() and SECRET not in done.stdout + done.stderr
    assert (done.returncode, done.stderr) == (0, "") and "template: " in done.stdout


def spec(tmp_path: Path, template: str) -> JobSpec:
    (tmp_path / "t.j2").write_text(template)
    # signal: null: a template need not extend ddpkit's then (tests/jobs/test_user_template.py)
    return JobSpec(name="n", command="t.py", workdir=str(tmp_path), template="t.j2", signal=None)


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 10**12 }}",  # a plain environment folds this at compile time: MemoryError
        "{{ [1] * 10**12 }}",
        "{{ 7 ** 1000000000 }}",  # minutes of CPU and 350 MB for one number
        "{% for i in range(10) %}{{ 'x' * 100000000 }}{% endfor %}",
    ],
)
def test_templates_cannot_build_huge_values(tmp_path: Path, source: str) -> None:
    with pytest.raises(ConfigError, match=r"sbatch template .*t\.j2, line 1: .*too (big|long)"):
        render.render_sbatch(spec(tmp_path, source))


def test_output_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpkit.jobs import sandbox

    monkeypatch.setattr(sandbox, "MAX_SCRIPT_CHARS", 1000)
    source = "{% for i in range(100) %}{{ 'x' * 50 }}\n{% endfor %}"
    with pytest.raises(ConfigError, match=r"t\.j2: the script is longer than 1000 characters"):
        render.render_sbatch(spec(tmp_path, source))


def test_what_templates_may_do_still_works(tmp_path: Path) -> None:
    """Loops, filters, string methods and formatting of the context are not sandbox escapes."""
    job = spec(
        tmp_path,
        "{% for key, value in sbatch_options %}{{ key | upper }}{{ loop.index }} {% endfor %}"
        "{{ '%s-%d' | format(name, nodes) }} {{ '{}:{}'.format(name, procs) }} "
        "{{ spec.model_dump()['name'] }} {{ command | map('q') | join(' ') }} "
        "{{ 'ab' * 2 }} {{ 2 ** 10 }} {{ sweep is none }}\n",
    )
    out = render.render_sbatch(job)
    assert out.startswith("JOB-NAME1 NODES2 ")
    assert out.endswith(" n-1 n:1 n t.py abab 1024 True\n")


# Files a template could read into the script it renders (and --dry-run prints) on the machine
# that renders it: the environment, through /proc, and anything outside the template's folder.
READS = {
    "proc-environ": '{% include "/proc/self/environ" %}',
    "proc-environ-relative": '{% include "../../../../../../../../proc/self/environ" %}',
    "import-outside": '{% import "../outside.j2" as x %}{{ x }}',
    "symlink-out": '{% include "link.j2" %}',
}


@pytest.mark.parametrize("payload", READS.values(), ids=list(READS))
def test_templates_read_only_files_in_their_own_folder(
    tmp_path: Path, payload: str, ddpkit_here: Callable[..., Any]
) -> None:
    folder = tmp_path / "templates"
    folder.mkdir()
    (tmp_path / "outside.j2").write_text(f"{{% macro m() %}}{SECRET}{{% endmacro %}}{SECRET}\n")
    (folder / "link.j2").symlink_to(tmp_path / "outside.j2")
    (folder / "evil.sbatch.j2").write_text("#!/bin/bash\n" + payload + "\n")
    spec = tmp_path / "job.yaml"
    # signal: null: any template is accepted, so the script would be printed as rendered
    spec.write_text(
        "name: demo\ncommand: train.py\ntemplate: templates/evil.sbatch.j2\nsignal: null\n"
    )
    done = ddpkit_here(tmp_path, "submit", "--dry-run", str(spec))
    assert SECRET not in done.stdout + done.stderr, "the template read a file outside its folder"
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith("ddpkit: error: ") and done.stderr.count("\n") == 1
    assert "outside the template's folder" in done.stderr and "(hint: " in done.stderr


def test_a_template_includes_files_of_its_own_folder_wherever_ddpkit_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative names are the template's folder's (they were the current directory's)."""
    folder = tmp_path / "site"
    (folder / "parts").mkdir(parents=True)
    (folder / "parts" / "mail.j2").write_text("#SBATCH --mail-type=END\n")
    (folder / "t.j2").write_text(
        "{% extends launch_template %}"
        '{% block sbatch_extra %}{% include "parts/mail.j2" %}{% endblock %}'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    job = JobSpec(name="n", command="t.py", workdir=str(tmp_path), template="site/t.j2")
    assert "\n#SBATCH --mail-type=END\n" in render.render_sbatch(job)
