"""``cpu_bind`` and ``gpu_bind``: srun's ``--cpu-bind``/``--gpu-bind`` on the job step
(:mod:`ddpkit.jobs.spec_bind`), through the spec, plan, the script (run with a stand-in srun),
submitit's srun arguments and torchx's refusal."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.errors import ConfigError
from ddpkit.jobs import render
from ddpkit.jobs.backends.submitit import executor_parameters
from ddpkit.jobs.backends.torchx_appdef import refuse_sweep
from ddpkit.jobs.layout import format_plan
from ddpkit.jobs.spec import JobSpec
from tests.support.jobcli import submit_refused

BASE: dict[str, Any] = {"name": "b", "command": ["t.py"], "python": "/py", "workdir": "/w"}


def spec(**fields: Any) -> JobSpec:
    return JobSpec(**(BASE | fields))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_bind", "cores"),
        ("cpu_bind", "verbose,map_cpu:0,4"),
        ("cpu_bind", "mask_cpu:0x3,0xC"),
        ("cpu_bind", "none"),
        ("gpu_bind", "closest"),
        ("gpu_bind", "single:1"),
        ("gpu_bind", "verbose,per_task:2"),
        ("gpu_bind", "map_gpu:0,1*2"),
    ],
)
def test_srun_values_are_taken_as_written(field: str, value: str) -> None:
    assert getattr(spec(**{field: value}), field) == value


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("cpu_bind: cores --exclusive", "cpu_bind='cores --exclusive': has 'cores --exclusive'"),
        ("cpu_bind: 'cores;touch x'", "not a value srun takes"),
        ("cpu_bind: '-cores'", "not a value srun takes"),
        ("cpu_bind: ''", "not a value srun takes"),
        ("cpu_bind: corez", "has 'corez', which srun does not know"),
        ("gpu_bind: cores", "has 'cores', which srun does not know"),
        ("gpu_bind: 'closest\\n#SBATCH --x'", "not a value srun takes"),
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


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
@pytest.mark.parametrize("signal", ["USR2", None])
def test_the_job_steps_srun_gets_the_options(launch: str, signal: str | None) -> None:
    job = spec(launch=launch, signal=signal, cpu_bind="map_cpu:0,4", gpu_bind="closest")
    script = render.render_sbatch(job)
    steps = [line for line in script.splitlines() if line.startswith("srun $resv_ports")]
    assert len(steps) == 1, script
    options = " --cpu-bind=map_cpu:0,4 --gpu-bind=closest "
    assert options in steps[0]
    assert steps[0].index(options) < steps[0].index(" --cpus-per-task=")  # srun's, not the job's
    plain = render.render_sbatch(spec(launch=launch, signal=signal))
    assert "-bind" not in plain


def test_the_rendered_script_hands_srun_the_options(tmp_path: Path) -> None:
    from tests.jobs.test_render import nul_list, run_script

    job = spec(python=sys.executable, workdir=str(tmp_path), cpu_bind="cores", gpu_bind="none")
    (call,) = run_script(render.render_sbatch(job), tmp_path)["srun"]
    words = nul_list(call / "argv")
    assert "--cpu-bind=cores" in words and "--gpu-bind=none" in words
    assert words.index("--gpu-bind=none") < words.index(sys.executable)  # srun's, not the job's


def test_plan_says_it_and_submitit_carries_it_and_torchx_refuses() -> None:
    job = spec(cpu_bind="cores")
    cpus = "\n# binding: srun --cpu-bind=cores\n# cpus on each node: srun's choice"
    assert cpus in format_plan(job)
    both = format_plan(spec(cpu_bind="none", gpu_bind="closest"))
    gpus = "# binding: srun --cpu-bind=none --gpu-bind=closest (srun picks each task's GPUs)"
    assert gpus in both
    assert "# binding" not in format_plan(spec())
    assert "# cpus" not in format_plan(spec(gpu_bind="closest"))
    assert executor_parameters(job)["slurm_srun_args"] == ["--cpu-bind=cores"]
    assert "slurm_srun_args" not in executor_parameters(spec())
    with pytest.raises(ConfigError) as info:
        refuse_sweep(spec(gpu_bind="closest"))
    assert str(info.value).startswith("gpu_bind='closest' is srun's --gpu-bind, which torchx")


# ---- numa_binding: torchrun's --numa-binding on each node's ddpkit run --------------------


def test_numa_binding_is_on_the_ddpkit_run_line_the_script_runs(tmp_path: Path) -> None:
    from tests.jobs.test_render import nul_list, run_script

    fields = {"python": sys.executable, "workdir": str(tmp_path), "launch": "torchrun"}
    job = spec(numa_binding="socket", procs_per_node=2, **fields)
    argv = render.torchrun_command(job, endpoint="h:1", rdzv_id="9")
    assert argv[argv.index("--rdzv-id") + 2 :] == ["--numa-binding", "socket", "t.py"]
    (call,) = run_script(render.render_sbatch(job), tmp_path)["srun"]
    words = nul_list(call / "argv")
    assert words[words.index("--numa-binding") :] == ["--numa-binding", "socket", "t.py"]
    assert "--numa-binding" not in render.torchrun_command(spec(**fields))
    plan = format_plan(job)
    assert "# binding: ddpkit run --numa-binding socket (torch's agent binds" in plan


def test_torchx_replicas_get_numa_binding_too() -> None:
    pytest.importorskip("torchx")
    from ddpkit.jobs.backends.torchx_appdef import spec_to_appdef

    role = spec_to_appdef(spec(launch="torchrun", numa_binding="node")).roles[0]
    assert "--numa-binding node t.py" in " ".join(role.args)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("numa_binding: node", "numa_binding='node': is torchrun's --numa-binding, for launch"),
        ("launch: torchrun\nnuma_binding: nodes", "numa_binding"),
    ],
)
def test_numa_binding_refused_where_nothing_carries_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    line: str,
    words: str,
) -> None:
    assert words in submit_refused(tmp_path, monkeypatch, capsys, line)
