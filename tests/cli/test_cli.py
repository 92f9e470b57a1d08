"""``ddpkit`` / ``ddpkit run`` argument handling: flags -> RunConfig, PET_* fallback, errors.

Everything here is in-process and never launches workers (see test_run.py for launches).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cli import main
from ddpkit.cli.run import config_from_argv
from ddpkit.launch.config import DEFAULTS, SWITCHES, RunConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/scripts/env_worker.py"


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Script paths are relative to the current directory; no PET_* from the outside."""
    monkeypatch.chdir(ROOT)
    for name in list(os.environ):
        if name.startswith("PET_") or name == "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE":
            monkeypatch.delenv(name)


def fields(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def test_defaults_are_torchruns_plus_tee_and_implied_standalone() -> None:
    config = config_from_argv([SCRIPT], env={})
    assert config == RunConfig(script=SCRIPT)
    assert fields(config) | {"rdzv_conf": ()} == {
        "script": SCRIPT,
        "script_args": (),
        "min_nodes": 1,
        "max_nodes": 1,
        "nproc_per_node": 1,
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "master_port": None,
        "rdzv_backend": "static",
        "rdzv_endpoint": "",
        "rdzv_id": "none",
        "rdzv_conf": (),
        "standalone": True,
        "max_restarts": 0,
        "monitor_interval_s": 0.1,
        "start_method": "spawn",
        "role": "default",
        "log_dir": None,
        "redirects": "0",
        "tee": "3",
        "local_ranks_filter": (),
        "local_addr": None,
        "numa_binding": None,
        "module": False,
        "no_python": False,
        "run_path": False,
        "log_line_prefix_template": "[rank${rank}]: ",
    }


def test_run_config_is_frozen() -> None:
    config = config_from_argv([SCRIPT], env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.nproc_per_node = 2  # type: ignore[misc]


# (flags, expected fields); each valued flag in its dash and its underscore spelling
FLAG_CASES: list[tuple[list[str], dict[str, Any]]] = [
    (["--nnodes", "2"], {"min_nodes": 2, "max_nodes": 2, "standalone": False}),
    (["--nnodes=1:4"], {"min_nodes": 1, "max_nodes": 4, "standalone": False}),
    (["--nproc-per-node", "4"], {"nproc_per_node": 4}),
    (["--nproc_per_node=4"], {"nproc_per_node": 4}),
    (["--nproc-per-node", "cpu"], {"nproc_per_node": "cpu"}),
    (["--nproc_per_node", "auto"], {"nproc_per_node": "auto"}),
    (["--nnodes", "2", "--node-rank", "1"], {"node_rank": 1}),
    (["--nnodes", "2", "--node_rank", "1"], {"node_rank": 1}),
    (["--master-addr", "node7"], {"master_addr": "node7"}),
    (["--master_addr", "node7"], {"master_addr": "node7"}),
    (["--master-port", "29501"], {"master_port": 29501, "standalone": False}),
    (["--master_port", "29501"], {"master_port": 29501, "standalone": False}),
    (["--rdzv-backend", "c10d"], {"rdzv_backend": "c10d", "standalone": False}),
    (["--rdzv_backend", "c10d"], {"rdzv_backend": "c10d", "standalone": False}),
    (["--rdzv-endpoint", "node1:29400"], {"rdzv_endpoint": "node1:29400", "standalone": False}),
    (["--rdzv_endpoint", "[::1]:29400"], {"rdzv_endpoint": "[::1]:29400", "standalone": False}),
    (["--rdzv-id", "job42"], {"rdzv_id": "job42"}),
    (["--rdzv_id", "job42"], {"rdzv_id": "job42"}),
    (["--rdzv-conf", "join_timeout=900,a=b"], {"rdzv_conf": (("join_timeout", "900"), ("a", "b"))}),
    (["--rdzv_conf", "read_timeout=60"], {"rdzv_conf": (("read_timeout", "60"),)}),
    (["--max-restarts", "3"], {"max_restarts": 3}),
    (["--max_restarts", "3"], {"max_restarts": 3}),
    (["--monitor-interval", "0.5"], {"monitor_interval_s": 0.5}),
    (["--monitor_interval", "2"], {"monitor_interval_s": 2.0}),
    (["--start-method", "fork"], {"start_method": "fork"}),
    (["--start_method", "forkserver"], {"start_method": "forkserver"}),
    (["--role", "trainer"], {"role": "trainer"}),
    (["--log-dir", "/tmp/logs"], {"log_dir": "/tmp/logs"}),
    (["--log_dir", "/tmp/logs"], {"log_dir": "/tmp/logs"}),
    (["-r", "3"], {"redirects": "3", "tee": "0"}),
    (["--redirects", "0:1,1:2"], {"redirects": "0:1,1:2", "tee": "0"}),
    (["-t", "1"], {"tee": "1", "redirects": "0"}),
    (["--tee", "0"], {"tee": "0", "redirects": "0"}),
    (["--local-ranks-filter", "1,0"], {"local_ranks_filter": (0, 1)}),
    (["--local_ranks_filter", "0"], {"local_ranks_filter": (0,)}),
    (["--local-addr", "10.0.0.2"], {"local_addr": "10.0.0.2"}),
    (["--local_addr", "10.0.0.2"], {"local_addr": "10.0.0.2"}),
    (["--numa-binding", "socket"], {"numa_binding": "socket"}),
    (["--numa_binding", "core-complex"], {"numa_binding": "core-complex"}),
    (["--standalone", "--nnodes", "2"], {"standalone": True, "max_nodes": 2}),
    (["--no-python"], {"no_python": True}),
    (["--no_python"], {"no_python": True}),
]


@pytest.mark.parametrize(("flags", "expected"), FLAG_CASES, ids=" ".join)
def test_flag_becomes_field(flags: list[str], expected: dict[str, Any]) -> None:
    config = config_from_argv([*flags, SCRIPT], env={})
    assert {key: fields(config)[key] for key in expected} == expected


def test_every_valued_flag_has_a_case() -> None:
    spelled = {
        flag.split("=")[0].lstrip("-").replace("-", "_")
        for flags, _ in FLAG_CASES
        for flag in flags
        if flag.startswith("--")
    }
    assert set(DEFAULTS) - spelled == set()


def test_module_run_path_and_script_args() -> None:
    module = config_from_argv(["-m", "pkg.train", "--lr", "0.1", "-m", "x"], env={})
    assert (module.module, module.script, module.script_args) == (
        True,
        "pkg.train",
        ("--lr", "0.1", "-m", "x"),
    )
    assert config_from_argv(["--module", "pkg.train"], env={}).module
    run_path = config_from_argv(["--run_path", SCRIPT], env={})
    assert run_path.run_path and run_path.script == str(ROOT / SCRIPT)
    command = config_from_argv(["--no-python", "python3", "-c", "pass"], env={})
    assert (command.script, command.script_args) == ("python3", ("-c", "pass"))


@pytest.mark.parametrize(
    ("flags", "standalone"),
    [
        ([], True),
        (["--master-port", "29500"], False),
        (["--rdzv-endpoint", "localhost:29400"], False),
        (["--nnodes", "2"], False),
        (["--nnodes", "1:2"], False),
        (["--rdzv-backend", "c10d"], False),
        (["--standalone", "--master-port", "29500"], True),
    ],
)
def test_standalone_implied_on_one_node_without_port(flags: list[str], standalone: bool) -> None:
    assert config_from_argv([*flags, SCRIPT], env={}).standalone is standalone


# (PET_ variable, value, field, expected)
PET_CASES: list[tuple[str, str, str, Any]] = [
    ("PET_NPROC_PER_NODE", "3", "nproc_per_node", 3),
    ("PET_NNODES", "1:2", "max_nodes", 2),
    ("PET_MASTER_ADDR", "node9", "master_addr", "node9"),
    ("PET_MASTER_PORT", "29600", "master_port", 29600),
    ("PET_RDZV_BACKEND", "c10d", "rdzv_backend", "c10d"),
    ("PET_RDZV_ID", "abc", "rdzv_id", "abc"),
    ("PET_MAX_RESTARTS", "2", "max_restarts", 2),
    ("PET_MONITOR_INTERVAL", "1.5", "monitor_interval_s", 1.5),
    ("PET_ROLE", "critic", "role", "critic"),
    ("PET_TEE", "2", "tee", "2"),
    ("PET_REDIRECTS", "1", "redirects", "1"),
    ("PET_LOCAL_RANKS_FILTER", "0", "local_ranks_filter", (0,)),
    ("PET_STANDALONE", "1", "standalone", True),
    ("PET_MODULE", "1", "module", True),
    ("PET_NPROC_PER_NODE", "", "nproc_per_node", 1),  # empty counts as unset
    ("PET_MODULE", "0", "module", False),
]


@pytest.mark.parametrize(("name", "value", "field", "expected"), PET_CASES)
def test_pet_environment_fallback(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, field: str, expected: Any
) -> None:
    monkeypatch.setenv(name, value)
    assert fields(config_from_argv([SCRIPT]))[field] == expected


def test_flag_beats_pet_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_MASTER_PORT", "29600")
    config = config_from_argv(["--nproc-per-node", "2", SCRIPT])
    assert (config.nproc_per_node, config.master_port, config.standalone) == (2, 29600, False)
    assert config_from_argv([SCRIPT]).nproc_per_node == 3


def test_prefix_template_follows_torchs_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "<${local_rank}> ")
    assert config_from_argv([SCRIPT]).log_line_prefix_template == "<${local_rank}> "


# (argv after "run", PET_ environment, fragment the one-line error must contain)
BAD_CASES: list[tuple[list[str], dict[str, str], str]] = [
    (["--nproc-per-node=abc", SCRIPT], {}, "--nproc-per-node='abc' is not a process count"),
    (["--nproc-per-node", "0", SCRIPT], {}, "--nproc-per-node='0'"),
    (["--nproc-per-node", "gpus", SCRIPT], {}, "did you mean 'gpu'"),
    (["--nnodes", "3:2", SCRIPT], {}, "--nnodes='3:2' needs 0 < MIN <= MAX"),
    (["--nnodes", "two", SCRIPT], {}, "--nnodes='two' is not N or MIN:MAX"),
    (["--nnodes", "1:2:3", SCRIPT], {}, "--nnodes='1:2:3'"),
    (["--nnodes", "0", SCRIPT], {}, "--nnodes='0'"),
    (["--node-rank", "-1", SCRIPT], {}, "--node-rank='-1' is not an integer >= 0"),
    (["--nnodes", "2", "--node-rank", "2", SCRIPT], {}, "--node-rank=2 is not below --nnodes=2"),
    (["--master-port", "70000", SCRIPT], {}, "--master-port='70000' is not a TCP port"),
    (["--master-port", "http", SCRIPT], {}, "--master-port='http'"),
    (["--master-addr", "", SCRIPT], {}, "--master-addr='' is empty"),
    (["--rdzv-backend", "c10", SCRIPT], {}, "did you mean 'c10d'"),
    (["--rdzv-endpoint", "node1:port", SCRIPT], {}, "--rdzv-endpoint='node1:port'"),
    (["--rdzv-conf", "timeout", SCRIPT], {}, "--rdzv-conf='timeout' has 'timeout'"),
    (["--max-restarts", "-1", SCRIPT], {}, "--max-restarts='-1'"),
    (["--monitor-interval", "0", SCRIPT], {}, "--monitor-interval='0' is not a positive"),
    (["--start-method", "thread", SCRIPT], {}, "--start-method='thread' is not supported"),
    (["--redirects", "4", SCRIPT], {}, "--redirects='4' is not a stream spec"),
    (["--tee", "0:x", SCRIPT], {}, "--tee='0:x'"),
    (["--tee", "3\n", SCRIPT], {}, "--tee='3\\n' is not a stream spec"),
    (["--redirects", "0:1\n", SCRIPT], {}, "--redirects='0:1\\n'"),
    (["--rdzv-endpoint", "node1:29400\n", SCRIPT], {}, "--rdzv-endpoint='node1:29400\\n'"),
    (["--rdzv-endpoint", "node1\n", SCRIPT], {}, "--rdzv-endpoint='node1\\n'"),
    (["--local-ranks-filter", "a,b", SCRIPT], {}, "--local-ranks-filter='a,b'"),
    (["--numa-binding", "nodes", SCRIPT], {}, "--numa-binding='nodes' is not supported"),
    (["--role", " ", SCRIPT], {}, "--role=' ' is empty"),
    (["missing.py"], {}, "script 'missing.py' not found"),
    (["tests"], {}, "script 'tests' is a directory"),
    (["-m", "--no-python", "pkg"], {}, "--module and --no-python both given"),
    (["--no-python", "no-such-command-xyz"], {}, "command 'no-such-command-xyz' not found"),
    ([SCRIPT], {"PET_NPROC_PER_NODE": "abc"}, "PET_NPROC_PER_NODE='abc' is not a process count"),
    ([SCRIPT], {"PET_NNODES": "3:2"}, "PET_NNODES='3:2'"),
    ([SCRIPT], {"PET_STANDALONE": "yes"}, "PET_STANDALONE='yes' is not 0 or 1"),
]


@pytest.mark.parametrize(("argv", "env", "fragment"), BAD_CASES)
def test_bad_value_is_one_line_and_exit_code_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    fragment: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("ddpkit: error: ") and fragment in err, err
    assert "(hint: " in err


@pytest.mark.parametrize(
    "argv",
    [[], ["bogus"], ["run"], ["run", "--nproc-per-node"], ["run", "--nproc", "2", SCRIPT]],
    ids=["no-command", "unknown-command", "no-script", "missing-value", "no-abbreviations"],
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(argv) == 2
    assert "usage: ddpkit" in capsys.readouterr().err


def test_help_lists_both_spellings_and_pet_variables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "run" in capsys.readouterr().out
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for dest in [*DEFAULTS, *SWITCHES]:
        dashed = "--" + dest.replace("_", "-")
        assert dashed in out and f"PET_{dest.upper()}" in out, dest
    assert "--nproc_per_node" in out and "-r REDIRECTS" not in out
    assert "Precedence: command-line flag > PET_<FLAG> environment variable > default" in out


def test_dry_run_prints_the_equivalent_torchrun_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--dry-run", "--nproc_per_node", "2", SCRIPT, "--x", "a b"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]: ' torchrun ")
    assert "--nproc-per-node=2 " in out and "--tee=3 " in out and "--standalone " in out
    assert out.rstrip().endswith(f"{SCRIPT} --x 'a b'")


@pytest.mark.parametrize(
    ("argv", "code"), [(["run", "--dry-run", SCRIPT], 0), (["run", "--nnodes=x", SCRIPT], 2)]
)
def test_ddpkit_run_imports_none_of_the_job_commands(argv: list[str], code: int) -> None:
    # the job commands' modules (specs, records, backends, SLURM tools) cost every launch
    # ~20 ms that torchrun does not pay; `ddpkit run` builds its own parser alone
    script = (
        "import sys; from ddpkit.cli import main; rc = main(sys.argv[1:]); "
        "jobs = sorted(m for m in sys.modules if m.startswith(('ddpkit.jobs', 'ddpkit.cli.jobs',"
        " 'ddpkit.cli.tools', 'ddpkit.cluster.slurmtools.commands')));"
        "print(jobs); sys.exit(rc)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stdout.splitlines()[-1]) == (code, "[]"), done.stderr


def test_every_other_command_still_parses_with_the_full_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["status", "--help"]) == 0
    assert "usage: ddpkit status" in capsys.readouterr().out
    assert main(["ru", SCRIPT]) == 2  # not `run`: the full parser names the choices
    assert "invalid choice: 'ru'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["run", "--help"], ["run", "--dry-run", SCRIPT], ["run", "--nnodes=x", SCRIPT]],
)
def test_cli_without_a_launch_never_imports_torch(argv: list[str]) -> None:
    code = (
        "import sys; from ddpkit.cli import main; rc = main(sys.argv[1:]); "
        "sys.exit(100 if 'torch' in sys.modules else rc)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode in (0, 2), done.stderr
