"""sbatch scripts from job specs: golden files, quoting, executing them, user templates.

Golden files live in tests/golden/; after an intended change regenerate them with
``DDPKIT_REGEN_GOLDEN=1 python -m pytest tests/jobs/test_render.py`` and review the diff.
The rendered scripts are also *run* under bash with ``srun``/``scontrol``/``sbatch`` replaced
by stub executables that record their argv and environment (NUL-separated: arguments may hold
newlines), so hostile values are checked by what a real shell makes of them. The real
cluster's view is in test_render_slurm.py.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cluster.rendezvous.endpoint import endpoint
from ddpkit.cluster.rendezvous.ports import port_for_job
from ddpkit.cluster.slurmtools.config import has_port_range, parse_config
from ddpkit.contract import STOP_HOLD_MODULE
from ddpkit.errors import ConfigError
from ddpkit.jobs import render
from ddpkit.jobs.spec import JobSpec
from tests.fakes.slurm import FakeTools
from tests.support.golden import GOLDEN, REGEN_VAR, check_golden

# Relative `touch` targets: any injection that runs leaves a file named pwned* behind.
EVIL = 'it\'s "dq"; $(touch pwned1) `touch pwned2` $HOME * ünï ☃ 100% \\back'
EVIL_PATH = "it's;$(touch pwned3) `touch pwned4` ünï 50%"  # no backslash: SLURM patterns
EVIL_COMMAND = ["train script.py", EVIL, "--flag=$(touch pwned5)", "two\nlines", "", '"$endpoint"']
EVIL_ENV = {"EVIL": EVIL, "MULTILINE": "one\ntwo\n", "EMPTY": "", "EXPAND": "$SLURM_JOB_ID ${HOME}"}


def spec(**fields: Any) -> JobSpec:
    base: dict[str, Any] = {
        "name": "cpu-train",
        "command": ["train.py", "--lr", "0.1"],
        "python": "/opt/venv/bin/python",
        "workdir": "/srv/proj",
    }
    return JobSpec(**(base | fields))


def hostile_spec(launch: str, root: str, python: str | None = None) -> JobSpec:
    """Every field that reaches the shell or an #SBATCH line, hostile."""
    return spec(
        name="hostile.job_1-x",
        command=EVIL_COMMAND,
        python=python or f"{root}/py {EVIL_PATH}/python",
        workdir=f"{root}/work {EVIL_PATH}",
        log_dir=f"logs {EVIL_PATH}",
        nodes=2,
        procs_per_node=2,
        launch=launch,
        rdzv_port=29400,
        env=EVIL_ENV,
        setup=['echo "setup ran in $PWD" > setup-ran.txt'],
        sbatch={"comment": EVIL, "exclusive": True, "overcommit": False},
        host_template="{host}-ib $(touch pwned6)",
    )


def gpu_spec(launch: str) -> JobSpec:
    """A site's GPU job: partition, account, QOS, constraint, extras, setup, NCCL variables."""
    return spec(
        name="gpu-train",
        command=["-m", "pkg.train", "--epochs", "3"],
        nodes=2,
        gpus_per_node=4,
        cpus_per_task=8,
        mem_gb=256,
        time_min=240,
        partition="gpu",
        account="ml-team",
        qos="high",
        constraint="a100&ib",
        launch=launch,
        rdzv_port="auto",
        env={"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "ib0"},
        setup=["module load cuda/12.4", "source /opt/venv/bin/activate"],
        sbatch={"exclusive": True, "mail-type": "END,FAIL"},
        signal="USR1",
        signal_delay_s=90,
        max_requeues=3,
        host_template="{host}-ib",
    )


GOLDEN_SPECS = {
    "srun-cpu-2x2": lambda: spec(nodes=2, procs_per_node=2, env={"OMP_NUM_THREADS": "1"}),
    "torchrun-cpu-2x2": lambda: spec(
        nodes=2, procs_per_node=2, launch="torchrun", rdzv_port="auto", cpus_per_task=2
    ),
    "srun-gpu-2x4": lambda: gpu_spec("srun"),
    "torchrun-gpu-2x4": lambda: gpu_spec("torchrun"),
    "srun-hostile": lambda: hostile_spec("srun", "/srv/evil"),
    "torchrun-hostile": lambda: hostile_spec("torchrun", "/srv/evil"),
    # a health check with quotes and $(): one word for bash -c on each node
    "srun-health": lambda: spec(
        nodes=2,
        health_check="""nvidia-smi -L > /dev/null && test -w "$TMPDIR" # it's $(fine)""",
        health_check_timeout_s=30,
        max_excluded_nodes=1,
        sbatch={"exclude": "n4"},
    ),
    # a chain (job ids: names are resolved at submission) and one rank's lines per node
    "torchrun-chain": lambda: spec(
        nodes=2,
        procs_per_node=4,
        launch="torchrun",
        after=["1234", "1230_7"],
        after_type="afterany",
        singleton=True,
        log_ranks=[0],
    ),
    # the step's tasks in an image: pyxis's srun options; apptainer around each task's argv
    "srun-pyxis": lambda: spec(
        nodes=2,
        container={
            "runtime": "pyxis",
            "image": "nvcr.io#nvidia/pytorch:24.01-py3",
            "mounts": ["/srv/proj", "/data:/data:ro"],
            "workdir": "/srv/proj",
        },
    ),
    "torchrun-apptainer": lambda: spec(
        nodes=2,
        procs_per_node=2,
        launch="torchrun",
        health_check="nvidia-smi -L",
        container={
            "runtime": "apptainer",
            "image": "/images/torch.sif",
            "mounts": ["/data:ro"],
            "workdir": "/workspace",
            "python": "python3",
        },
    ),
}


# ---- golden files ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_golden(name: str) -> None:
    text = render.render_sbatch(GOLDEN_SPECS[name]())
    assert text == render.render_sbatch(GOLDEN_SPECS[name]())  # deterministic
    check_golden(GOLDEN / f"{name}.sbatch", text, what="rendered script")


def test_golden_mismatch_shows_a_unified_diff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REGEN_VAR, raising=False)
    (tmp_path / "x.sbatch").write_text("a\nb\nc\n")
    with pytest.raises(pytest.fail.Exception) as caught:
        check_golden(tmp_path / "x.sbatch", "a\nB\nc\n", what="rendered script")
    assert "-b\n+B\n" in str(caught.value)
    assert f"{REGEN_VAR}=1" in str(caught.value)
    with pytest.raises(pytest.fail.Exception, match="missing"):
        check_golden(tmp_path / "y.sbatch", "a\n", what="rendered script")
    monkeypatch.setenv(REGEN_VAR, "1")
    check_golden(tmp_path / "y.sbatch", "new\n", what="rendered script")
    assert (tmp_path / "y.sbatch").read_text() == "new\n"


# ---- the pieces ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "present", "absent"),
    [
        (
            {},
            ["--job-name=cpu-train", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1"],
            ["--gpus-per-node=0", "--mem", "--partition"],
        ),
        ({"nodes": 2, "procs_per_node": 3, "cpus_per_task": 2}, ["--ntasks-per-node=3"], []),
        (
            {"procs_per_node": 3, "cpus_per_task": 2, "launch": "torchrun"},
            ["--ntasks-per-node=1", "--cpus-per-task=6"],
            [],
        ),
        ({"gpus_per_node": 4}, ["--ntasks-per-node=4", "--gpus-per-node=4"], []),
        (
            {"gpus_per_node": 2, "sbatch": {"gres": "gpu:a100:2"}},
            ["--gres=gpu:a100:2"],
            ["--gpus-per-node=2"],
        ),
        ({"mem_gb": 64}, ["--mem=64G"], []),
        ({"mem_gb": 1.3}, ["--mem=1332M"], []),
        ({"time_min": 5}, ["--time=5"], []),
        ({"partition": "p", "account": "a b"}, ["--partition=p", "--account=a b"], ["--qos"]),
        ({"log_dir": "l 100%"}, ["--output=/srv/proj/l 100%%/cpu-train-%j.out"], []),
        ({"log_dir": "/abs"}, ["--output=/abs/cpu-train-%j.out", "--chdir=/srv/proj"], []),
        (
            {"sbatch": {"exclusive": True, "overcommit": False, "nice": 5}},
            ["--exclusive", "--nice=5"],
            ["--overcommit"],
        ),
        # the stop signal: 120 s before the limit, at most half of it; requeue unless capped at 0
        ({}, ["--signal=B:USR2@120", "--requeue", "--open-mode=append"], ["--no-requeue"]),
        ({"time_min": 3}, ["--signal=B:USR2@90"], []),
        ({"time_min": 1}, ["--signal=B:USR2@30"], []),
        ({"signal": "USR1", "signal_delay_s": 300}, ["--signal=B:USR1@300"], []),
        ({"signal": None}, ["--requeue"], ["--signal"]),
        ({"max_requeues": 0}, ["--no-requeue"], ["--requeue"]),
        ({"sbatch": {"open-mode": "truncate"}}, ["--open-mode=truncate"], []),
    ],
)
def test_sbatch_options(fields: dict[str, Any], present: list[str], absent: list[str]) -> None:
    options = render.sbatch_options(spec(**fields))
    lines = [f"--{key}" + ("" if value is None else f"={value}") for key, value in options]
    assert set(present) <= set(lines)
    assert not [line for line in lines for option in absent if line.startswith(option)]
    assert len(lines) == len({line.split("=")[0] for line in lines})  # each option once


def sbatch_parse(text: str) -> str:
    """One word as sbatch reads it from an #SBATCH line.

    A transcription of ``_get_argument`` in SLURM's src/sbatch/opt.c: a backslash escapes the
    next character everywhere (inside single quotes too), quotes of either kind group, an
    unquoted ``#`` or whitespace ends the word. The real sbatch is checked in
    test_render_slurm.py.
    """
    word: list[str] = []
    quote, escape = "", False
    for char in text:
        if escape:
            escape = False
        elif char == "\\":
            escape = True
            continue
        elif quote:
            if char == quote:
                quote = ""
                continue
        elif char in "\"'":
            quote = char
            continue
        elif char == "#" or char.isspace():
            break
        word.append(char)
    return "".join(word)


@pytest.mark.parametrize(
    ("value", "quoted"),
    [
        ("gpu", "gpu"),
        ("/p/x-%j.out", "/p/x-%j.out"),
        ("a b", '"a b"'),
        ("it's", '"it\'s"'),
        ('d"q', '"d\\"q"'),
        ("back\\slash", '"back\\\\slash"'),
        ("cut#here", '"cut#here"'),
        ("$(x) `y`", '"$(x) `y`"'),
        ("", '""'),
    ],
)
def test_sbatch_quote(value: str, quoted: str) -> None:
    assert render.sbatch_quote(value) == quoted
    assert sbatch_parse(quoted) == value


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\x00b"])
def test_sbatch_quote_refuses_line_breaks(value: str) -> None:
    with pytest.raises(ConfigError, match="newline"):
        render.sbatch_quote(value)


def test_q_round_trips_through_bash_and_passes_only_its_own_expansions(tmp_path: Path) -> None:
    values = [EVIL, EVIL_PATH, "two\nlines", "", "~", "-n", '"$endpoint"', "ünï ☃"]
    words = " ".join(render.shell_quote(value) for value in values)
    command = ["bash", "-c", f"printf '%s\\0' {words}"]
    out = subprocess.run(command, capture_output=True, check=False, env={}, cwd=tmp_path).stdout
    assert out.decode().split("\0")[:-1] == values
    assert not list(tmp_path.iterdir())  # no injected `touch` ran
    assert render.shell_quote(render.ENDPOINT_EXPANSION) == '"$endpoint"'
    assert render.shell_quote('"$endpoint"') == "'\"$endpoint\"'"
    with pytest.raises(ConfigError, match="NUL"):
        render.shell_quote("a\x00b")


@pytest.mark.parametrize(("field", "value"), [("log_dir", "a\\b"), ("workdir", "/srv/a\\b")])
def test_a_backslash_in_a_log_path_is_refused(field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}=.* contains a backslash") as caught:
        render.render_sbatch(spec(**{field: value}))
    assert "%j" in str(caught.value.hint)


def test_torchrun_command_and_output_paths() -> None:
    job = spec(nodes=2, procs_per_node=4, launch="torchrun", rdzv_port=29400, log_dir="l%")
    assert render.torchrun_command(job, endpoint="n1:29400", rdzv_id="77") == [
        *("/opt/venv/bin/python", "-u", "-m", "ddpkit", "run", "--nnodes", "2"),
        *("--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400"),
        *("--rdzv-id", "77", "train.py", "--lr", "0.1"),
    ]
    assert render.task_output_pattern(job) == "/srv/proj/l%%/cpu-train-%j-node%n.out"
    assert render.batch_output_path(job, "77") == "/srv/proj/l%/cpu-train-77.out"
    odd = spec(log_dir="%j %%")
    assert render.batch_output_path(odd) == "/srv/proj/%%j %%%%/cpu-train-%j.out"
    assert render.batch_output_path(odd, "77") == "/srv/proj/%j %%/cpu-train-77.out"
    assert render.endpoint_command(job)[-2:] == ["--port", "29400"]


# ---- user templates --------------------------------------------------------------------------


def test_user_template_gets_the_same_context(tmp_path: Path) -> None:
    (tmp_path / "t.j2").write_text("{{ name | q }} {{ world_size }} {{ spec.nodes }}\n")
    # signal: null: no stop-signal protocol to keep, so any template (jobs/test_user_template.py)
    job = spec(workdir=str(tmp_path), template="t.j2", nodes=3, name="n", signal=None)
    assert render.render_sbatch(job) == "n 3 3\n"
    # A user template may extend a built-in one: the same text comes out.
    (tmp_path / "inc.j2").write_text("{% extends launch_template %}")
    extended = render.render_sbatch(spec(workdir=str(tmp_path), template=str(tmp_path / "inc.j2")))
    assert extended == render.render_sbatch(spec(workdir=str(tmp_path)))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (None, r"template='.*/missing\.j2' cannot be read: No such file or directory"),
        ("a\n{% if %}\n", r"sbatch template .*/t\.j2, line 2: Expected an expression"),
        ("a\nb\n{{ nope }}\n", r"sbatch template .*/t\.j2, line 3: 'nope' is undefined"),
        ("{{ spec.nope }}", r"sbatch template .*/t\.j2, line 1: .*has no attribute 'nope'"),
        ("{{ name | nofilter }}", r"sbatch template .*/t\.j2, line 1: No filter named 'nofilter'"),
        ("a\n{{ 1 / 0 }}", r"sbatch template .*/t\.j2, line 2: ZeroDivisionError: division by"),
        ("{{ 2.0 ** 100000 }}", r"sbatch template .*/t\.j2, line 1: OverflowError: "),
        ("{{ 'a' + 1 }}", r"sbatch template .*/t\.j2, line 1: TypeError: can only concat"),
    ],
)
def test_template_errors_name_the_file_and_line(
    tmp_path: Path, source: str | None, message: str
) -> None:
    name = "missing.j2" if source is None else "t.j2"
    if source is not None:
        (tmp_path / name).write_text(source)
    with pytest.raises(ConfigError, match=message) as caught:
        render.render_sbatch(spec(workdir=str(tmp_path), template=name))
    assert caught.value.hint


# ---- executing the scripts -------------------------------------------------------------------


def run_script(text: str, tmp_path: Path) -> dict[str, list[Path]]:
    """Run ``text`` under bash with stub srun/scontrol/sbatch; the calls each stub recorded."""
    stubs, records = tmp_path / "stubs", tmp_path / "records"
    FakeTools(stubs).recorders("srun", "scontrol", "sbatch", "squeue")
    records.mkdir()
    script = tmp_path / f"script dir {EVIL_PATH}" / "job.sbatch"
    script.parent.mkdir()
    script.write_text(text, encoding="utf-8")
    env = {
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "LANG": "C.UTF-8",
        "RECORD_DIR": str(records),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "n[3-4]",
    }
    result = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    calls: dict[str, list[Path]] = {}
    for call in sorted(records.iterdir()):
        calls.setdefault(call.name.split(".")[0], []).append(call)
    return calls


# The srun line's --resv-ports probe, in the job's shell: the same answer as the Python rule
# (has_port_range) on the same configuration texts, and none when scontrol fails or hangs.
PORT_RANGE_CONFIGS = [
    "MpiDefault              = none\nMpiParams               = ports=12000-12999\n",
    "MpiParams               = (null)\n",
    "MpiParams = ports=20000-20100,disable_slurm_hydra_bootstrap\n",
    "  mpiparams=PORTS=1-2\n",
    "PrologFlags = ports=1\nMpiParams = (null)\n",  # ports= elsewhere is not it
    "",
]


def probe_lines(text: str, bound_s: int | None = None) -> str:
    """The probe of a rendered script (its ``resv_ports=`` line to its ``fi``), and a line
    printing what it decided; ``bound_s`` replaces its scontrol bound (a hang test's wait)."""
    lines = text.splitlines()
    start = lines.index("resv_ports=")
    probe = "\n".join(lines[start : lines.index("fi", start) + 1])
    assert "timeout 20 scontrol show config" in probe
    if bound_s is not None:
        probe = probe.replace("timeout 20 ", f"timeout {bound_s} ")
    return f'set -euo pipefail\n{probe}\nprintf "[%s]" "$resv_ports"\n'


def run_probe(text: str, path: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``text`` under bash with ``path`` as PATH (bash itself found here)."""
    bash = shutil.which("bash")
    assert bash is not None
    return subprocess.run(
        [bash, "-c", text], env={**os.environ, "PATH": path}, cwd=tmp_path,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
@pytest.mark.parametrize("config", PORT_RANGE_CONFIGS)
def test_the_scripts_resv_ports_probe_follows_the_python_rule(
    tmp_path: Path, launch: str, config: str
) -> None:
    tools = FakeTools(tmp_path / "bin")
    tools.scontrol_config(config)
    text = render.render_sbatch(spec(launch=launch))
    assert text.count("resv_ports=") == 2 and "srun $resv_ports " in text  # probe, then the flag
    assert "-m ddpkit.cluster.rendezvous.resv_ports" not in text  # no Python before the step
    flag = "--resv-ports=1" if has_port_range(parse_config(config)) else ""
    done = run_probe(probe_lines(text), tools.path(), tmp_path)
    assert (done.returncode, done.stdout) == (0, f"[{flag}]"), done.stderr


@pytest.mark.parametrize("failure", ["exits", "missing", "hangs"])
def test_the_scripts_resv_ports_probe_never_stops_the_job(tmp_path: Path, failure: str) -> None:
    tools = FakeTools(tmp_path / "bin")
    ports = "MpiParams = ports=12000-12999"
    if failure == "exits":  # prints a port range, then fails: not an answer
        tools.install("scontrol", f"#!/bin/sh\necho '{ports}'\nexit 1\n")
    elif failure == "hangs":  # prints a port range, then never ends: bounded, no flag
        tools.install("scontrol", f"#!/bin/sh\necho '{ports}'\nexec sleep 600\n")
    if failure == "missing":  # a PATH with the probe's other tools and no scontrol at all
        for tool in ("timeout", "grep"):
            found = shutil.which(tool)
            assert found is not None
            (tools.bin / tool).symlink_to(found)
        path = str(tools.bin)
    else:
        path = tools.path()
    done = run_probe(probe_lines(render.render_sbatch(spec()), bound_s=1), path, tmp_path)
    assert (done.returncode, done.stdout) == (0, "[]"), done.stderr


def nul_list(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_rendered_script_runs_with_hostile_values_intact(tmp_path: Path, launch: str) -> None:
    python = tmp_path / f"py {EVIL_PATH}" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    job = hostile_spec(launch, str(tmp_path), str(python))
    Path(job.workdir).mkdir()
    calls = run_script(render.render_sbatch(job), tmp_path)

    # one srun, and the port-reservation probe's one `scontrol show config`: nothing else
    assert sorted(calls) == ["scontrol", "srun"]
    (probe,) = calls["scontrol"]
    assert nul_list(probe / "argv") == ["show", "config"]
    (call,) = calls["srun"]
    log = f"{tmp_path}/work {EVIL_PATH}/logs {EVIL_PATH}".replace("%", "%%")
    if launch == "srun":
        expected = ["--kill-on-bad-exit=1", "--cpus-per-task=1", "--open-mode=append"]
        expected += [f"--output={log}/hostile.job_1-x-%j-rank%t.out", str(python), "-u"]
    else:
        port = port_for_job("4242", "rdzv")
        rdzv = "n3-ib $(touch pwned6):29400"
        assert port != 29400
        expected = ["--kill-on-bad-exit=1", "--ntasks-per-node=1", "--cpus-per-task=2"]
        expected += ["--open-mode=append", f"--output={log}/hostile.job_1-x-%j-node%n.out"]
        expected += [str(python), "-u"]
        expected += ["-m", "ddpkit", "run", "--nnodes", "2", "--nproc-per-node", "2"]
        expected += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "4242"]
        host_env = {"SLURM_JOB_NODELIST": "n[3-4]", "DDPKIT_HOST_TEMPLATE": job.host_template}
        assert endpoint(host_env, "29400") == rdzv
        argv = render.torchrun_command(job, endpoint=rdzv, rdzv_id="4242")
        assert argv == [*expected[5:], *EVIL_COMMAND]
    expected += EVIL_COMMAND
    argv = nul_list(call / "argv")
    # each task runs under the stop-signal holder: PYTHON -m ddpkit.cluster.stop.hold COMMAND
    at = argv.index(STOP_HOLD_MODULE) - 2
    assert argv[at : at + 2] == [str(python), "-m"], argv
    assert argv[:at] + argv[at + 3 :] == expected

    seen = dict(item.split("=", 1) for item in nul_list(call / "env"))
    assert {key: seen[key] for key in job.env} == job.env
    assert seen["DDPKIT_EXPECTED_WORLD_SIZE"] == "4"
    assert seen["DDPKIT_JOB_LAUNCH"] == launch
    assert seen["DDPKIT_HOST_TEMPLATE"] == "{host}-ib $(touch pwned6)"
    assert (call / "cwd").read_text() == job.workdir
    assert Path(job.workdir, job.log_dir).is_dir()
    assert Path(job.workdir, "setup-ran.txt").read_text() == f"setup ran in {job.workdir}\n"
    assert not [p for p in tmp_path.rglob("pwned*") if p.name.startswith("pwned")]
