"""``container``: the job step's tasks in an image, under pyxis (srun's ``--container-*``
options) or apptainer (``apptainer exec ... IMAGE`` before each task's argv), through the spec,
``--set``, plan, the script (run with a stand-in srun and a stand-in apptainer that record their
argv and run the task), submitit's parameters and torchx's refusal
(:mod:`ddpkit.jobs.spec_container`). No container runtime runs here: what is verified is the
argv each runtime would get, and that the task's command runs behind it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cli import main
from ddpkit.errors import ConfigError
from ddpkit.jobs import render
from ddpkit.jobs.backends.submitit import command_line, executor_parameters, submitit_python
from ddpkit.jobs.backends.torchx_appdef import refuse_sweep
from ddpkit.jobs.layout import format_plan
from ddpkit.jobs.load import parse_overrides
from ddpkit.jobs.spec import JobSpec
from tests.fakes.slurm import RECORDER, FakeTools
from tests.support.jobcli import submit_refused

BASE: dict[str, Any] = {"name": "c", "command": ["t.py"], "python": "/py", "workdir": "/w"}
PYXIS = {"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.01-py3"}
APPTAINER = {"runtime": "apptainer", "image": "/images/torch.sif"}


def spec(**fields: Any) -> JobSpec:
    return JobSpec(**(BASE | fields))


def step_line(script: str) -> str:
    (line,) = [line for line in script.splitlines() if line.startswith("srun $resv_ports")]
    return line


def test_values_are_taken_and_mounts_written_out_as_src_dst_flags() -> None:
    container = {**APPTAINER, "mounts": "/data:ro", "workdir": "/ws", "python": "python3"}
    got = spec(container=container).container
    assert got is not None
    assert (got.mounts, got.workdir, got.python) == (["/data:/data:ro"], "/ws", "python3")
    mounts = ["/a", "/a:/b", "/a:/b:rw", "/a:rw"]
    got = spec(container={**PYXIS, "mounts": mounts}).container
    assert got is not None
    assert got.mounts == ["/a:/a", "/a:/b", "/a:/b:rw", "/a:/a:rw"]
    for image in ("docker://pytorch/pytorch:2.4", "/i/t.sqsh", "oras://r.io/x@sha256:ab"):
        assert spec(container={**PYXIS, "image": image}).container is not None


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("container: {image: /i.sif}", "container.runtime"),
        ("container: {runtime: docker, image: /i.sif}", "container.runtime"),
        ("container: {runtime: pyxis}", "container.image"),
        ("container: {runtime: pyxis, image: '-x'}", "not an image path or reference"),
        ("container: {runtime: pyxis, image: 'a b'}", "not an image path or reference"),
        ("container: {runtime: pyxis, image: 'a,b'}", "not an image path or reference"),
        ("container: {runtime: pyxis, image: 'a;touch x'}", "not an image path or reference"),
        ('container: {runtime: pyxis, image: "i\\n#SBATCH --x"}', "not an image path"),
        ("container: {runtime: pyxis, image: i, mounts: ['/a,/b']}", "not SRC[:DST][:ro|rw]"),
        ("container: {runtime: pyxis, image: i, mounts: ['/a:/b:exec']}", "not SRC[:DST]"),
        ("container: {runtime: pyxis, image: i, mounts: ['/a:/b:/c:ro']}", "not SRC[:DST]"),
        ("container: {runtime: pyxis, image: i, mounts: [data:/data]}", "not SRC[:DST]"),
        ("container: {runtime: pyxis, image: i, mounts: ['/a --x']}", "not SRC[:DST]"),
        ("container: {runtime: pyxis, image: i, workdir: ws}", "not an absolute path"),
        ("container: {runtime: pyxis, image: i, workdir: '/w:/x'}", "not an absolute path"),
        ("container: {runtime: pyxis, image: i, python: '-c'}", "not an interpreter"),
        ("container: {runtime: pyxis, image: i, python: 'py x'}", "not an interpreter"),
        ("container: {runtime: pyxis, image: i, shell: sh}", "container.shell"),
    ],
)
def test_a_bad_value_is_one_line_exit_2_and_nothing_is_submitted(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    line: str,
    words: str,
) -> None:
    assert words in submit_refused(tmp_path, monkeypatch, capsys, line)


def test_set_takes_container_fields_one_by_one_over_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_overrides(["container.image=/i.sif", "container.mounts=[/a, /b:ro]"]) == {
        "container": {"image": "/i.sif", "mounts": ["/a", "/b:ro"]}
    }
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    path = tmp_path / "c.yaml"
    path.write_text("name: c\ncommand: t.py\ncontainer: {runtime: pyxis, image: /old.sqsh}\n")
    assert main(["plan", str(path), "--set", "container.image=/new.sqsh"]) == 0
    out = capsys.readouterr().out
    assert "# container: each task runs in srun --container-image=/new.sqsh with " in out
    assert main(["submit", str(path), "--dry-run", "--set", "container.runtime=apptainer"]) == 0
    (step,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("srun $")]
    assert " apptainer exec /old.sqsh " in step


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
@pytest.mark.parametrize("signal", ["USR2", None])
def test_pyxis_options_are_on_the_job_steps_srun_line(launch: str, signal: str | None) -> None:
    container = {**PYXIS, "mounts": ["/data:ro", "/s:/scratch"], "workdir": "/ws"}
    job = spec(launch=launch, signal=signal, container=container)
    script = render.render_sbatch(job)
    step = step_line(script)
    options = (
        " '--container-image=nvcr.io#nvidia/pytorch:24.01-py3' "
        "--container-mounts=/data:/data:ro,/s:/scratch --container-workdir=/ws "
    )
    assert options in step
    assert step.index(options) < step.index(" --cpus-per-task=") < step.index(" /py ")
    assert script.count("--container-") == 3  # the step only: not the health check's srun
    assert "--container-" not in render.render_sbatch(spec(launch=launch, signal=signal))


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
@pytest.mark.parametrize("signal", ["USR2", None])
def test_apptainer_wraps_each_tasks_argv_and_helpers_stay_on_the_host(
    launch: str, signal: str | None
) -> None:
    container = {**APPTAINER, "mounts": ["/data"], "workdir": "/ws", "python": "python3"}
    script = render.render_sbatch(spec(launch=launch, signal=signal, container=container))
    step = step_line(script)
    wrap = ".out apptainer exec --bind /data:/data --pwd /ws "  # after srun's last option
    tail = "/images/torch.sif python3 -m " if signal else "/images/torch.sif python3 -u "
    assert f"{wrap}{tail}" in step, step
    assert script.count("apptainer exec") == 1
    if launch == "torchrun":
        assert 'endpoint="$(/py -m ddpkit.cluster.rendezvous.endpoint' in script  # host
        assert " python3 -u -m ddpkit run --nnodes" in step
    else:
        assert step.endswith("python3 -u t.py &" if signal else "python3 -u t.py")


# ---- the script run with a stand-in srun (and apptainer) that record and run the task ----

# srun's options are each one word (--x=y); the task's argv follows them
RUNNING_SRUN = RECORDER + 'while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n'
# `apptainer exec [--bind M]... [--pwd D] IMAGE ARGV...`: records, enters D, runs ARGV
FAKE_APPTAINER = (
    RECORDER
    + """[ "$1" = exec ] || exit 64
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --bind) shift 2 ;;
    --pwd) cd -- "$2" || exit 65; shift 2 ;;
    -*) exit 64 ;;
    *) break ;;
  esac
done
shift
exec "$@"
"""
)
TASK = "import json, os, sys; json.dump([os.getcwd(), sys.argv[1:]], open('ran.json', 'w'))\n"


def run_with_stand_ins(job: JobSpec, tmp_path: Path) -> dict[str, list[str]]:
    """Run ``job``'s script under bash with the stand-ins; each one's recorded argv."""
    tools, records = FakeTools(tmp_path / "bin"), tmp_path / "records"
    tools.install("srun", RUNNING_SRUN)
    tools.install("apptainer", FAKE_APPTAINER)
    tools.recorders("scontrol")
    records.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(render.render_sbatch(job), encoding="utf-8")
    env = {
        "PATH": tools.path(),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "HOME": str(tmp_path),
        "RECORD_DIR": str(records),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "n1",
    }
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return {
        call.name.split(".")[0]: (call / "argv").read_bytes().decode().split("\0")[:-1]
        for call in records.iterdir()
    }


@pytest.mark.parametrize("signal", ["USR2", None])
def test_the_script_runs_the_task_through_apptainer(tmp_path: Path, signal: str | None) -> None:
    inside = tmp_path / "in_image"  # stands for the image's /workspace
    inside.mkdir()
    (inside / "t.py").write_text(TASK)
    container = {**APPTAINER, "mounts": ["/data:ro"], "workdir": str(inside)}
    container["python"] = sys.executable  # stands for the image's interpreter
    fields = {"workdir": str(tmp_path), "signal": signal, "command": ["t.py", "--lr", "0.1"]}
    calls = run_with_stand_ins(spec(container=container, **fields), tmp_path)
    assert calls["apptainer"][:6] == [
        "exec", "--bind", "/data:/data:ro", "--pwd", container["workdir"], "/images/torch.sif",
    ]  # fmt: skip
    holder = ["-m", "ddpkit.cluster.stop.hold"]
    task = [sys.executable, "-u", "t.py", "--lr", "0.1"]
    assert calls["apptainer"][6:] == ([sys.executable, *holder] if signal else []) + task
    assert calls["srun"].index("apptainer") > calls["srun"].index("--cpus-per-task=1")
    cwd, argv = json.loads((inside / "ran.json").read_text())
    assert (cwd, argv) == (container["workdir"], ["--lr", "0.1"])


def test_the_script_hands_srun_the_pyxis_options_and_runs_the_task(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(TASK)
    container = {**PYXIS, "mounts": [str(tmp_path)], "workdir": str(tmp_path)}
    job = spec(workdir=str(tmp_path), python=sys.executable, container=container)
    calls = run_with_stand_ins(job, tmp_path)
    argv = calls["srun"]
    options = [word for word in argv if word.startswith("--container-")]
    assert options == [
        "--container-image=nvcr.io#nvidia/pytorch:24.01-py3",
        f"--container-mounts={tmp_path}:{tmp_path}",
        f"--container-workdir={tmp_path}",
    ]
    assert argv.index(options[-1]) < argv.index(sys.executable)  # srun's, not the task's
    assert "apptainer" not in calls
    assert json.loads((tmp_path / "ran.json").read_text()) == [str(tmp_path), []]


# ---- plan, submitit, torchx --------------------------------------------------------------


def test_plan_says_it_submitit_carries_it_and_torchx_refuses() -> None:
    job = spec(container={**APPTAINER, "python": "python3"})
    plan = "# container: each task runs in apptainer exec /images/torch.sif with python3; helpers"
    assert plan in format_plan(job)
    assert "# container" not in format_plan(spec())
    assert submitit_python(job) == "apptainer exec /images/torch.sif python3"
    assert command_line(job) == ["python3", "-u", "t.py"]
    assert "slurm_srun_args" not in executor_parameters(job)
    pyxis = spec(container={**PYXIS, "workdir": "/ws"}, cpu_bind="cores")
    assert executor_parameters(pyxis)["slurm_srun_args"] == [
        "--cpu-bind=cores",
        "--container-image=nvcr.io#nvidia/pytorch:24.01-py3",
        "--container-workdir=/ws",
    ]
    assert (submitit_python(pyxis), command_line(pyxis)[0]) == ("/py", "/py")
    assert submitit_python(spec(python="/my py")) == "'/my py'"
    with pytest.raises(ConfigError) as info:
        refuse_sweep(job)
    assert str(info.value).startswith("container (runtime apptainer) runs ddpkit's job step")


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_submitits_own_script_carries_it_on_its_srun_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime: str
) -> None:
    pytest.importorskip("submitit")
    from ddpkit import compat
    from ddpkit.jobs.backends.submitit import make_executor

    tools = FakeTools(tmp_path / "bin")
    tools.srun()  # submitit renders its script only where srun is on PATH
    monkeypatch.setenv("PATH", tools.path())
    image = {"runtime": runtime, "image": "/i.sif", "mounts": ["/d"], "python": "python3"}
    text = compat.submitit_sbatch_text(make_executor(spec(workdir=str(tmp_path), container=image)))
    (step,) = [line for line in text.splitlines() if line.startswith("srun ")]
    if runtime == "pyxis":
        assert " --container-image=/i.sif --container-mounts=/d:/d " in step
        assert " python3 -u -m submitit.core._submit " in step
    else:
        assert " apptainer exec --bind /d:/d /i.sif python3 -u -m submitit.core._submit " in step
    assert text.count("container-image") + text.count("apptainer") == 1
