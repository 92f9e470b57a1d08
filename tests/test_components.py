"""ddpkit as a torchx component: registration, validation, the spec conversion, real runs.

Golden AppDefs live in tests/golden/*.appdef.json; after an intended change regenerate them with
``DDPKIT_REGEN_GOLDEN=1 python -m pytest tests/test_components.py`` and review the diff.
Real runs: ``torchx run -s local_cwd`` (CLI; a torch-free payload, tests/scripts/report_rank_env.py:
what the CLI run shows is where each rank lands) and ``torchx.runner`` (Python API; ranks that
form the group and all-reduce) on this machine, and ``torchx run -s slurm`` on the test cluster in
tests/test_components_cluster.py.
"""

# ruff: noqa: E402  (the imports below come after the check that torchx is there)
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import needs
from tests.support.golden import GOLDEN, check_golden

needs.module("torchx")  # before torchx is imported below

from torchx.runner import get_runner
from torchx.specs import AppState, file_linter, finder

from ddpkit import components
from ddpkit.errors import ConfigError
from ddpkit.jobs.backends.torchx_appdef import appdef_to_dict, parse_j, spec_to_appdef
from ddpkit.jobs.load import load_spec
from ddpkit.jobs.spec import JobSpec

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
REPORT = ROOT / "tests" / "scripts" / "report_rank.py"
RANKS_ONLY = ROOT / "tests" / "scripts" / "report_rank_env.py"  # torch-free, no group
TORCHX = [sys.executable, "-m", "torchx.cli.main"]
REPORT_LINE = re.compile(r"\[rank(\d+)\]: (\{.*\})")


# these tests call torchx's own runner, whose local scheduler sets SIGINT and SIGTERM handlers
# in pytest's process and leaves them (ddpkit's backend puts the caller's back)
pytestmark = pytest.mark.usefixtures("signals_put_back")


def torchx_cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 180):
    return subprocess.run(
        [*TORCHX, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def reports(text: str) -> list[dict[str, Any]]:
    """The JSON lines report_rank.py printed (ddpkit run prefixes them with [rankN])."""
    found = []
    for match in REPORT_LINE.finditer(text):
        report = json.loads(match[2])
        assert report["rank"] == int(match[1])
        found.append(report)
    return sorted(found, key=lambda r: r["rank"])


def check_world(
    found: list[dict[str, Any]], nodes: int, procs: int, *, grouped: bool = True
) -> dict[str, list[int]]:
    """All ranks once, launcher torchrun, all_reduce right (``grouped``: report_rank.py's
    lines; report_rank_env.py's have no group), procs per node; ranks by node."""
    world = nodes * procs
    assert [r["rank"] for r in found] == list(range(world)), found
    assert {(r["world_size"], r["launcher"]) for r in found} == {(world, "torchrun")}, found
    if grouped:
        assert {r["sum"] for r in found} == {world * (world + 1) // 2}, found
    by_node: dict[str, list[int]] = {}
    for report in found:
        by_node.setdefault(report["node"], []).append(report["local_rank"])
    assert sorted(sorted(v) for v in by_node.values()) == [list(range(procs))] * len(by_node)
    return by_node


# ---- registration and validation ------------------------------------------------------------


def test_builtins_lists_ddpkit_beside_torchx_own() -> None:
    done = torchx_cli("builtins", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    listed = set(re.findall(r"^\s*\d+\. (\S+)$", done.stdout, re.MULTILINE))
    # what torchx lists when no package registers components: all must stay available
    found = finder.ModuleComponentsFinder("torchx.components", "").find()
    own = {c.name for c in found if not c.validation_errors}
    assert {"dist.ddp", "utils.echo"} <= own
    assert "ddpkit.ddp" in listed
    assert own - listed == set(), f"torchx builtins hidden by the entry point: {own - listed}"


def test_torchx_own_component_still_resolves() -> None:
    assert finder.get_component("dist.ddp").validation_errors == []
    assert finder.get_component("ddpkit.ddp").fn is components.ddp


def test_component_passes_torchx_linter() -> None:
    assert file_linter.validate(components.__file__, "ddp") == []
    assert finder.get_component("ddpkit.ddp").validation_errors == []


def test_help_is_readable() -> None:
    done = torchx_cli("run", "-s", "local_cwd", "ddpkit.ddp", "--help", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "DDP training with ddpkit" in text
    options = " ".join(text.partition("options:")[2].split())  # argparse wraps the help
    for flag, words in {
        "--j str": "nodes x processes per node",
        "--script str": "the training script",
        "--spec str": "a ddpkit job spec file",
        "--env str": "A=1,B=2",
        "--max_retries int": "restart",
    }.items():
        help_of_flag = options.split(f" {flag} ", 1)[-1][:160]
        assert words in help_of_flag, f"{flag!r}: {help_of_flag!r}"
    assert "TIP: improve this help string" not in text


# ---- the component function ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("j", "expected"), [("1x2", (1, 2)), ("2x1", (2, 1)), ("4", (1, 4)), (" 3x8 ", (3, 8))]
)
def test_parse_j(j: str, expected: tuple[int, int]) -> None:
    assert parse_j(j) == expected


@pytest.mark.parametrize("j", ["", "0x2", "2x0", "2x", "1:2x4", "ax2", "2*2", "٣", "2x٣", "1x²"])
def test_parse_j_rejects(j: str) -> None:
    with pytest.raises(ConfigError, match="is not NODESxPROCS"):
        parse_j(j)


def test_component_script_and_module() -> None:
    app = components.ddp("--lr", "0.1", script="train.py", j="2x4", cpu=8, gpu=4, memMB=2048)
    (role,) = app.roles
    assert (app.name, role.name, role.num_replicas, role.entrypoint) == (
        "ddpkit",
        "train",
        2,
        "bash",
    )
    assert (role.resource.cpu, role.resource.gpu, role.resource.memMB) == (8, 4, 2048)
    script = role.args[1]
    assert "--nnodes 2 --nproc-per-node 4 --rdzv-backend c10d" in script
    assert "${${rank0_env}:=localhost}" in script and "--rdzv-id ${app_id}" in script
    assert script.endswith("train.py --lr 0.1")
    module = components.ddp(m="pkg.train", j="3").roles[0]
    assert module.name == "train" and module.num_replicas == 1
    assert "--standalone" in module.args[1] and module.args[1].endswith("-m pkg.train")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "give exactly one"),
        ({"script": "a.py", "m": "pkg"}, "give exactly one"),
        ({"script": "a.py", "spec": "job.yaml"}, "together with a script"),
    ],
)
def test_component_rejects(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        components.ddp(**kwargs)


def test_component_never_mutates_callers_env(tmp_path: Path) -> None:
    env = {"A": "1", "LIST": "x,y"}
    app = components.ddp(script="t.py", env=env)
    # the local scheduler writes PATH into Role.env while building its request
    get_runner().dryrun(app, "local_cwd", cfg={"log_dir": str(tmp_path)})
    assert env == {"A": "1", "LIST": "x,y"}
    (role,) = app.roles
    assert role.env["A"] == "1" and "LIST" not in role.env  # srun --export cuts at commas
    assert "export LIST=x,y\n" in role.args[1]


def test_component_with_spec_file() -> None:
    app = components.ddp(spec=str(ROOT / "examples" / "jobs" / "train-srun.yaml"))
    assert appdef_to_dict(app) == appdef_to_dict(
        spec_to_appdef(load_spec(ROOT / "examples" / "jobs" / "train-srun.yaml"))
    )


# ---- the spec conversion ----------------------------------------------------------------------


def cpu_spec() -> JobSpec:
    return JobSpec(
        name="cpu-2x1",
        command=["train.py", "--tag", "it's $HOME"],
        python="/usr/bin/python3",
        nodes=2,
        procs_per_node=1,
        cpus_per_task=2,
        env={"PLAIN": "1", "DEVICES": "0,1", "DOLLAR": "$x $$"},
        setup=["echo setting up $USER"],
        workdir="/scratch/cpu job",
    )


GOLDEN_SPECS = {
    "full": lambda: load_spec(DATA / "specs" / "full.yaml", cwd=DATA),
    "cpu-2x1": cpu_spec,
}


def assert_golden(name: str, data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    check_golden(GOLDEN / f"{name}.appdef.json", text, what="AppDef")


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_golden_appdef(name: str) -> None:
    spec = GOLDEN_SPECS[name]()
    data = appdef_to_dict(spec_to_appdef(spec))
    assert data == appdef_to_dict(spec_to_appdef(spec))  # deterministic
    assert data == appdef_to_dict(spec_to_appdef(spec, scheduler="slurm"))  # macros do the rest
    assert_golden(name, data)


def test_spec_fields_reach_the_appdef() -> None:
    spec = load_spec(DATA / "specs" / "full.yaml", cwd=DATA)
    (role,) = spec_to_appdef(spec).roles
    assert (role.num_replicas, role.resource.cpu, role.resource.gpu) == (2, 32, 4)
    assert role.resource.memMB == 131584  # 128.5 GB
    assert role.env["DDPKIT_EXPECTED_WORLD_SIZE"] == "8"
    assert role.env["DDPKIT_JOB_LAUNCH"] == "torchrun"
    assert role.env["DDPKIT_HOST_TEMPLATE"] == "{host}-ib"
    assert role.port_map == {"c10d": 29400}
    lines = role.args[1].splitlines()
    assert lines[0] == "cd -- /scratch/full-job"
    assert lines[-1].startswith("exec /opt/venv/bin/python -u -m ddpkit run --nnodes 2")


def test_macros_and_dollars_after_substitution() -> None:
    """What a replica's bash gets once torchx's local scheduler applied its macros."""
    from torchx.specs import macros

    (role,) = spec_to_appdef(cpu_spec()).roles
    values = macros.Values(img_root="", app_id="app-7", replica_id="1", rank0_env="RANK0")
    done = values.apply(role)
    script = done.args[1]
    assert "echo setting up $USER" in script.splitlines()
    assert "export DEVICES=0,1" in script
    assert '"${RANK0:=localhost}:$(/usr/bin/python3 -c ' in script and "app-7)" in script
    assert "--rdzv-id app-7" in script and "'it'\"'\"'s $HOME'" in script
    assert done.env["DOLLAR"] == "$x $$"


def test_unknown_scheduler() -> None:
    with pytest.raises(ConfigError, match="scheduler='slrum' is not a torchx scheduler"):
        spec_to_appdef(cpu_spec(), scheduler="slrum")


def test_core_works_without_torchx(tmp_path: Path) -> None:
    """A meta-path blocker hides torchx: ddpkit's core runs, the torchx path names the extra."""
    code = f"""
import sys
from pathlib import Path
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torchx" or name.startswith("torchx."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
import ddpkit, ddpkit.jobs
from ddpkit.cli import main
from ddpkit.errors import ConfigError
from ddpkit.jobs.backends.torchx_appdef import spec_to_appdef
spec = ddpkit.jobs.load_spec({str(DATA / "specs" / "full.yaml")!r}, cwd=Path({str(DATA)!r}))
assert "#SBATCH" in ddpkit.jobs.render_sbatch(spec)
try:
    spec_to_appdef(spec)
except ConfigError as err:
    print("ERROR", err)
assert "torchx" not in sys.modules
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "ERROR torchx cannot be imported" in done.stdout
    assert "pip install ddpkit[torchx]" in done.stdout


# ---- real runs -------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_torchx_run_local_cwd_1x2(tmp_path: Path) -> None:
    """The component through torchx's CLI: each rank given its place by the ``ddpkit run`` the
    component starts. Torch-free ranks (a Python start each, not an ``import torch``): the
    group's forming under torchx's local scheduler is the runner test's below."""
    done = torchx_cli(
        "run", "-s", "local_cwd", "ddpkit.ddp", "-j", "1x2", "--python", sys.executable,
        "--script", str(RANKS_ONLY), cwd=tmp_path,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Job finished: SUCCEEDED" in output, output
    check_world(reports(output), nodes=1, procs=2, grouped=False)


@pytest.mark.multiproc
def test_runner_python_api_runs_a_spec(tmp_path: Path) -> None:
    """The pipeline-style call: a spec's AppDef through torchx.runner, 2 replicas x 1 process."""
    spec = JobSpec(
        name="api-2x1",
        command=[str(REPORT)],
        python=sys.executable,
        nodes=2,
        procs_per_node=1,
        workdir=str(tmp_path),
        setup=["echo setup ran > setup-marker"],
    )
    app = spec_to_appdef(spec)
    with get_runner() as runner:
        handle = runner.run(app, scheduler="local_cwd", cfg={"log_dir": str(tmp_path / "logs")})
        status = runner.wait(handle, wait_interval=0.5)
        assert status is not None and status.state == AppState.SUCCEEDED, status
        lines = [line for k in range(2) for line in runner.log_lines(handle, "api-2x1", k=k)]
    found = reports("\n".join(lines))
    # two "nodes" on one host: each replica is its own torchrun agent with one local rank
    assert {r["node"] for r in found} == {os.uname().nodename}
    assert [r["local_rank"] for r in found] == [0, 0]
    assert [r["rank"] for r in found] == [0, 1]
    assert {(r["world_size"], r["launcher"], r["sum"]) for r in found} == {(2, "torchrun", 3)}
    assert (tmp_path / "setup-marker").read_text() == "setup ran\n"
