"""JobSpec / ClusterProfile: types, defaults, derived values and every validation error.

Error cases go through ``build_spec`` so that they check the one line a user sees: the field
path, the bad value, the problem and a hint.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from ddpkit.errors import ConfigError
from ddpkit.jobs.load import build_spec
from ddpkit.jobs.render import endpoint_command
from ddpkit.jobs.spec import RESERVED_SBATCH, ClusterProfile, JobSpec

BASE: dict[str, Any] = {"name": "job", "command": "train.py"}


def spec(tmp_path: Path, **fields: Any) -> JobSpec:
    return build_spec({**BASE, **fields}, source="spec.yaml", cwd=tmp_path, env={}).spec


def error(tmp_path: Path, data: dict[str, Any], overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        build_spec(data, overrides, source="spec.yaml", cwd=tmp_path, env={})
    message = str(info.value)
    assert "\n" not in message, "an error is one line"
    assert info.value.__cause__ is None and info.value.__suppress_context__, "no chained traceback"
    return message


# -- valid specs ---------------------------------------------------------------------------

COMMANDS = [
    ("train.py", ["train.py"], False),
    ("train.py --lr 0.1", ["train.py", "--lr", "0.1"], False),
    ("train.py --name 'a b' --x=\"c d\"", ["train.py", "--name", "a b", "--x=c d"], False),
    (["train.py", "--lr", "0.1"], ["train.py", "--lr", "0.1"], False),
    (["train.py", "--epochs", 5, "--lr", 0.5], ["train.py", "--epochs", "5", "--lr", "0.5"], False),
    ("-m pkg.train --lr 0.1", ["-m", "pkg.train", "--lr", "0.1"], True),
    (["-m", "train"], ["-m", "train"], True),
    ("-m _private.sub_mod", ["-m", "_private.sub_mod"], True),
    ("scripts/train.py", ["scripts/train.py"], False),
]


@pytest.mark.parametrize(("command", "words", "module"), COMMANDS)
def test_commands(tmp_path: Path, command: object, words: list[str], module: bool) -> None:
    job = spec(tmp_path, command=command)
    assert job.command == words
    assert job.is_module is module


def test_defaults(tmp_path: Path) -> None:
    job = JobSpec(name="job", command="train.py")
    assert job.model_dump() == {
        "name": "job",
        "command": ["train.py"],
        "python": sys.executable,
        "nodes": 1,
        "min_nodes": None,
        "gpus_per_node": 0,
        "procs_per_node": None,
        "cpus_per_task": 1,
        "cpus_per_node": None,
        "mem_gb": None,
        "time_min": 60,
        "partition": None,
        "account": None,
        "qos": None,
        "constraint": None,
        "env": {},
        "setup": [],
        "launch": "srun",
        "rdzv_port": None,
        "log_dir": "ddpkit-logs",
        "workdir": str(Path.cwd()),
        "sbatch": {},
        "profile": None,
        "template": None,
        "host_template": None,
        "signal": "USR2",
        "signal_delay_s": None,
        "max_requeues": 10,
        "hang_timeout_s": None,
        "hang_first_timeout_s": None,
        "sweep": None,
        "health_check": None,
        "health_check_timeout_s": 60,
        "max_excluded_nodes": 2,
        "after": [],
        "after_type": "afterok",
        "singleton": False,
        "log_ranks": None,
        "snapshot": False,
        "cpu_bind": None,
        "gpu_bind": None,
        "numa_binding": None,
        "container": None,
    }
    assert job.warning_s == 120
    assert (job.procs, job.world_size, job.tasks_per_node, job.cpus_per_slurm_task) == (1, 1, 1, 1)
    assert spec(tmp_path).workdir == str(tmp_path)  # load's default workdir is its cwd


# nodes, gpus, procs, cpus_per_task, launch -> procs, world_size, tasks/node, cpus/SLURM task
TOPOLOGIES = [
    (1, 0, None, 1, "srun", 1, 1, 1, 1),
    (2, 0, 2, 1, "srun", 2, 4, 2, 1),
    (2, 0, 2, 3, "torchrun", 2, 4, 1, 6),
    (3, 4, None, 2, "srun", 4, 12, 4, 2),
    (2, 8, 8, 4, "torchrun", 8, 16, 1, 32),
    (1, 2, None, 1, "torchrun", 2, 2, 1, 2),
]


@pytest.mark.parametrize("case", TOPOLOGIES, ids=[repr(case) for case in TOPOLOGIES])
def test_derived_topology(tmp_path: Path, case: tuple[Any, ...]) -> None:
    nodes, gpus, procs, cpus, launch, resolved, world, tasks, task_cpus = case
    job = spec(
        tmp_path,
        nodes=nodes,
        gpus_per_node=gpus,
        procs_per_node=procs,
        cpus_per_task=cpus,
        launch=launch,
        rdzv_port="auto",
    )
    assert (job.procs, job.world_size) == (resolved, world)
    assert (job.tasks_per_node, job.cpus_per_slurm_task) == (tasks, task_cpus)


@pytest.mark.parametrize("port", ["auto", 1, 29400, 65535])
def test_rdzv_port_values(tmp_path: Path, port: object) -> None:
    assert spec(tmp_path, launch="torchrun", nodes=2, rdzv_port=port).rdzv_port == port


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_torchrun_without_rdzv_port_uses_the_job_derived_port(tmp_path: Path, nodes: int) -> None:
    job = spec(tmp_path, launch="torchrun", nodes=nodes)
    assert job.rdzv_port is None
    assert endpoint_command(job)[-2:] == ["--port", "auto"]
    assert endpoint_command(spec(tmp_path, launch="torchrun", nodes=nodes, rdzv_port=29400))[
        -2:
    ] == ["--port", "29400"]


def test_cpus_per_node_exactly_full(tmp_path: Path) -> None:
    job = spec(tmp_path, procs_per_node=4, cpus_per_task=16, cpus_per_node=64)
    assert job.procs * job.cpus_per_task == job.cpus_per_node


def test_env_numbers_become_strings(tmp_path: Path) -> None:
    job = spec(tmp_path, env={"OMP_NUM_THREADS": 4, "RATIO": 0.5, "_X1": "y"})
    assert job.env == {"OMP_NUM_THREADS": "4", "RATIO": "0.5", "_X1": "y"}


def test_setup_string_is_one_line(tmp_path: Path) -> None:
    assert spec(tmp_path, setup="module load cuda").setup == ["module load cuda"]


def test_sbatch_value_types(tmp_path: Path) -> None:
    extra = {"exclusive": True, "overcommit": False, "gres": "gpu:2", "nice": 10, "x11": "all"}
    assert spec(tmp_path, sbatch=extra).sbatch == extra


def test_log_path_is_relative_to_workdir() -> None:
    job = JobSpec(name="j", command="t.py", workdir="/w/run", log_dir="../logs")
    assert job.log_path == "/w/logs"
    assert JobSpec(name="j", command="t.py", workdir="/w", log_dir="/abs").log_path == "/abs"


def test_spec_is_frozen_and_strict() -> None:
    job = JobSpec(name="j", command="t.py")
    with pytest.raises(ValidationError):
        job.nodes = 2  # type: ignore[misc]
    with pytest.raises(ValidationError):
        JobSpec(name="j", command="t.py", nodes="2")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        JobSpec(name="j", command="t.py", workdir="relative/dir")


HOSTILE = {
    "command": ["train.py", "--msg", 'it\'s "q"; $(rm -rf /) `id` & | > <', "--x", "a\nb"],
    "env": {"MSG": "a'b\"c; $(whoami) `id` $HOME", "MULTI": "one\ntwo", "EMPTY": ""},
    "setup": ["echo 'x'; export Y=$(hostname) && true", "if true; then\n  echo hi\nfi"],
    "workdir": "/tmp/dir with spaces/it's; $(x)",
    "log_dir": "logs dir/'q'",
    "python": "/opt/my venv/bin/python",
    "partition": "a,b",
    "sbatch": {"comment": "a b; $(c) 'd'", "mail-user": "me@example.org"},
    "template": None,
}


def test_hostile_values_are_accepted_where_legitimate(tmp_path: Path) -> None:
    job = spec(tmp_path, **HOSTILE)
    assert job.model_dump(include=set(HOSTILE)) == HOSTILE


# -- errors: (fields, what the one line must contain) ---------------------------------------

ERRORS: list[tuple[dict[str, Any], list[str]]] = [
    ({"nodes": 0}, ["spec.yaml: nodes=0: is less than 1", "hint: a whole number >= 1"]),
    ({"nodes": "two"}, ["nodes='two': is not a whole number", "e.g. nodes: 2"]),
    ({"nodes": True}, ["nodes=True: is not a whole number"]),
    ({"nodes": 1.5}, ["nodes=1.5: is not a whole number"]),
    ({"gpus_per_node": -1}, ["gpus_per_node=-1: is less than 0", "0 on CPU nodes"]),
    ({"procs_per_node": 0}, ["procs_per_node=0: is less than 1"]),
    (
        {"gpus_per_node": 2, "procs_per_node": 4},
        ["procs_per_node=4: differs from gpus_per_node=2", "drop procs_per_node or set it to 2"],
    ),
    (
        {"procs_per_node": 4, "cpus_per_node": 2},
        ["procs_per_node=4: 4 processes x cpus_per_task=1 need 4 CPUs per node", "hint: lower"],
    ),
    (
        {"gpus_per_node": 4, "cpus_per_task": 8, "cpus_per_node": 16},
        ["procs_per_node=4: 4 processes x cpus_per_task=8 need 32 CPUs", "cpus_per_node=16"],
    ),
    ({"cpus_per_task": 0}, ["cpus_per_task=0: is less than 1", "CPUs per process"]),
    ({"mem_gb": 0}, ["mem_gb=0: is not greater than 0", "e.g. mem_gb: 32"]),
    ({"mem_gb": "32G"}, ["mem_gb='32G': is not a number", "e.g. mem_gb: 32"]),
    ({"mem_gb": float("inf")}, ["mem_gb=inf: input should be a finite number"]),
    ({"time_min": 0}, ["time_min=0: is less than 1", "minutes"]),
    ({"rdzv_port": 0}, ["rdzv_port=0: is not a TCP port or 'auto'", "1..65535"]),
    ({"rdzv_port": 65536}, ["rdzv_port=65536: is not a TCP port"]),
    ({"rdzv_port": "29400"}, ["rdzv_port='29400': is not a TCP port"]),
    ({"rdzv_port": "Auto"}, ["rdzv_port='Auto': is not a TCP port"]),
    ({"launch": "torchrn"}, ["launch='torchrn': is not one of", "did you mean 'torchrun'?"]),
    ({"launch": "mpi"}, ["launch='mpi': is not one of 'srun' or 'torchrun'", "hint: srun"]),
    ({"name": "my job"}, ["name='my job': may only contain", "e.g. 'my-job'"]),
    ({"name": "a/b"}, ["name='a/b'", "e.g. 'a-b'"]),
    ({"name": "x\n#SBATCH --y"}, ["name='x\\n#SBATCH --y': may only contain"]),
    ({"name": 12}, ["name=12: is not a string", "quote them"]),
    ({"name": None}, ["spec.yaml: name: is missing", "e.g. name: train-resnet"]),
    ({"command": None}, ["command: is missing", "hint:"]),
    ({"command": ""}, ["command='': is empty", "e.g. command: train.py --lr 0.1"]),
    ({"command": []}, ["command=[]: is empty"]),
    ({"command": "-m"}, ["command='-m': has '-m' without a module name", "-m pkg.train"]),
    ({"command": "-m 3pkg"}, ["command='-m 3pkg': has '3pkg' after '-m', which is not a module"]),
    ({"command": "-m pkg/train.py"}, ["has 'pkg/train.py' after '-m'"]),
    ({"command": "-u train.py"}, ["command='-u train.py': starts with '-u'", "e.g. command:"]),
    ({"command": "-mpkg.train"}, ["starts with '-mpkg.train'", "hint: write '-m pkg.train'"]),
    ({"command": "train.py 'open"}, ['command="train.py \'open": cannot be split', "YAML list"]),
    ({"command": ["train.py", True]}, ["command[1]=True: is not a string"]),
    ({"command": ["train.py\x00"]}, ["command[0]='train.py\\x00': contains a NUL character"]),
    ({"command": {"a": 1}}, ["command={'a': 1}: is not a list"]),
    ({"env": "A=1"}, ["env='A=1': is not a mapping", "env: {NCCL_DEBUG: INFO}"]),
    ({"env": {"1BAD": "x"}}, ["env.1BAD: is not a valid environment variable name", "'_1BAD'"]),
    ({"env": {"MY-VAR": "x"}}, ["env.MY-VAR: is not a valid", "e.g. 'MY_VAR'"]),
    ({"env": {"FLAG": True}}, ["env.FLAG=True: is not a string", "quote yes/no/true"]),
    ({"env": {"X": "a\x00b"}}, ["env.X='a\\x00b': contains a NUL"]),
    ({"env": {"DDPKIT_EXPECTED_WORLD_SIZE": "4"}}, ["env.DDPKIT_EXPECTED_WORLD_SIZE", "nodes x"]),
    ({"env": {"DDPKIT_HOST_TEMPLATE": "{host}"}}, ["set host_template instead"]),
    ({"env": {"DDPKIT_JOB_LAUNCH": "srun"}}, ["env.DDPKIT_JOB_LAUNCH", "from launch"]),
    ({"env": {"DDPKIT_SIGNAL": "USR1"}}, ["env.DDPKIT_SIGNAL", "set signal instead"]),
    ({"env": {"DDPKIT_MAX_REQUEUES": "1"}}, ["env.DDPKIT_MAX_REQUEUES", "set max_requeues"]),
    ({"signal": "TERM"}, ["signal='TERM': ", "USR2 (default) or USR1"]),
    ({"signal": 12}, ["signal=12: "]),
    ({"signal_delay_s": 0}, ["signal_delay_s=0: "]),
    ({"signal_delay_s": 3600}, ["signal_delay_s=3600: is not shorter than the time limit"]),
    ({"time_min": 2, "signal_delay_s": 120}, ["time_min=2, 120 s", "e.g. signal_delay_s: 60"]),
    ({"max_requeues": -1}, ["max_requeues=-1: "]),
    ({"hang_timeout_s": -1}, ["hang_timeout_s=-1: ", "e.g. hang_timeout_s: 300"]),
    ({"hang_first_timeout_s": 0}, ["hang_first_timeout_s=0: ", "hang_first_timeout_s: 1800"]),
    ({"env": {"DDPKIT_HANG_TIMEOUT": "5"}}, ["env.DDPKIT_HANG_TIMEOUT", "set hang_timeout_s"]),
    ({"max_requeues": "3"}, ["max_requeues='3': ", "e.g. max_requeues: 10"]),
    ({"setup": ["ok", 3]}, ["setup[1]=3: is not a string"]),
    ({"setup": ["ok", "bad\x00"]}, ["setup[1]='bad\\x00': contains a NUL"]),
    ({"sbatch": {"--exclusive": True}}, ["sbatch.--exclusive: starts with '-'", "'exclusive'"]),
    ({"sbatch": {"Exclusive": True}}, ["sbatch.Exclusive: is not an sbatch long option name"]),
    ({"sbatch": {"a_b": 1}}, ["sbatch.a_b: is not an sbatch long option name"]),
    ({"sbatch": {"nodes": 2}}, ["sbatch.nodes: is set by ddpkit", "hint: set nodes instead"]),
    ({"sbatch": {"mem-per-cpu": 1.5}}, ["sbatch.mem-per-cpu=1.5: is a float, not a string"]),
    ({"sbatch": {"gres": ["a"]}}, ["sbatch.gres=['a']: is a list, not a string"]),
    ({"sbatch": {"gres": "gpu:2\n#SBATCH --x"}}, ["sbatch.gres='gpu:2\\n#SBATCH --x'", "line"]),
    ({"sbatch": {"comment": ""}}, ["sbatch.comment='': is empty"]),
    ({"partition": "a\nb"}, ["partition='a\\nb': contains a line break", "one line"]),
    ({"account": "a\rb"}, ["account='a\\rb': contains a line break"]),
    ({"qos": "x\u2028y"}, ["qos='x\\u2028y': contains a line break"]),
    ({"constraint": ""}, ["constraint='': is empty", "write null"]),
    ({"partition": 5}, ["partition=5: is not a string", "e.g. partition: gpu"]),
    ({"log_dir": "logs\nx"}, ["log_dir='logs\\nx': contains a line break"]),
    ({"workdir": "/a\nb"}, ["workdir='/a\\nb': contains a line break"]),
    ({"python": ""}, ["python='': is empty"]),
    ({"python": "/bin/py\nthon"}, ["python='/bin/py\\nthon': contains a line break"]),
    ({"host_template": "{host}\n-ib"}, ["host_template='{host}\\n-ib': contains a line break"]),
    ({"host_template": "node-ib"}, ["host_template='node-ib': does not contain '{host}'"]),
    ({"profile": 3}, ["profile=3: is not a string"]),
    ({"template": ""}, ["template='': is empty"]),
    ({"node": 2}, ["spec.yaml: unknown key 'node'", "hint: did you mean 'nodes'?"]),
    ({"gpus": 2}, ["unknown key 'gpus'", "did you mean 'gpus_per_node'?"]),
    ({"mem": 2}, ["unknown key 'mem'", "did you mean 'mem_gb'?"]),
    ({"procs-per-node": 2}, ["unknown key 'procs-per-node'", "did you mean 'procs_per_node'?"]),
    ({"colour": "red"}, ["unknown key 'colour'", "known keys: name, command, python"]),
]


@pytest.mark.parametrize(("fields", "expected"), ERRORS, ids=[repr(f) for f, _ in ERRORS])
def test_errors(tmp_path: Path, fields: dict[str, Any], expected: list[str]) -> None:
    message = error(tmp_path, {**BASE, **fields})  # a null resets a field: name None is missing
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert "(hint: " in message


# A key or name that is valid but for a newline or CR at either end: ``$`` matches before a final
# newline, so a ``^...$`` check let "FOO\n" through and the script rendered ``export FOO`` and
# then a line ``=x``. Every name and key check refuses it, in the spec and in a profile.
STRAY = ["{}\n", "\n{}", "{}\r", "\r\n{}", " {}", "{}\t"]
KEY_CHECKS = [  # (field, a valid key, a value for it, the problem)
    ("env", "FOO", "x", "is not a valid environment variable name"),
    ("sbatch", "exclusive", True, "is not an sbatch long option name"),
]


@pytest.mark.parametrize("stray", STRAY, ids=repr)
@pytest.mark.parametrize("check", KEY_CHECKS, ids=["env", "sbatch"])
def test_keys_with_a_stray_line_break_or_space_are_refused(
    tmp_path: Path, stray: str, check: tuple[str, str, object, str]
) -> None:
    field, key, value, problem = check
    bad = stray.format(key)
    fields = {field: {bad: value}}
    message = error(tmp_path, {**BASE, **fields})
    assert message.startswith(f"spec.yaml: {field}[{bad!r}]: {problem}"), message
    assert f"hint: write {key!r}, without the surrounding whitespace" in message
    profile = tmp_path / "site.yaml"
    profile.write_text(yaml.safe_dump(fields))
    message = error(tmp_path, {**BASE, "profile": str(profile)})
    assert message.startswith(f"{profile}: {field}[{bad!r}]: {problem}"), message


@pytest.mark.parametrize("stray", STRAY, ids=repr)
def test_names_with_a_stray_line_break_or_space_are_refused(tmp_path: Path, stray: str) -> None:
    message = error(tmp_path, {**BASE, "name": stray.format("job")})
    assert f"name={stray.format('job')!r}: may only contain letters" in message
    assert "hint: write 'job', without the surrounding whitespace" in message
    module = stray.format("pkg.train")
    message = error(tmp_path, {**BASE, "command": ["-m", module]})
    assert f"has {module!r} after '-m', which is not a module name" in message


def test_unknown_key_is_reported_before_other_errors(tmp_path: Path) -> None:
    # the typo'd 'nmae' also makes 'name' missing: the typo is the cause worth naming
    message = error(tmp_path, {"nmae": "x", "command": "t.py", "nodes": 0})
    assert "unknown key 'nmae'" in message
    assert "did you mean 'name'?" in message


@pytest.mark.parametrize("key", sorted(RESERVED_SBATCH))
def test_every_reserved_sbatch_option_is_refused(tmp_path: Path, key: str) -> None:
    message = error(tmp_path, {**BASE, "sbatch": {key: "1"}})
    assert f"sbatch.{key}: is set by ddpkit" in message
    assert RESERVED_SBATCH[key] in message


def test_profile_model() -> None:
    profile = ClusterProfile(name="site", partition="gpu", env={"A": 1}, setup="module load x")
    assert profile.defaults() == {"partition": "gpu", "env": {"A": "1"}, "setup": ["module load x"]}
    with pytest.raises(ValidationError):
        ClusterProfile(name="site", nodes=2)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        ClusterProfile(name="site", partition="a\nb")
