"""One job contract: the sbatch templates, submitit and torchx hand the running job the same
DDPKIT_* variables, computed in one place (ddpkit.jobs.exports), named in one (ddpkit.contract)."""

from __future__ import annotations

import shlex
from typing import Any

import pytest
from pydantic import ValidationError

from ddpkit import contract
from ddpkit.jobs import exports, render
from ddpkit.jobs.spec import JobSpec
from tests.support import needs

BASE: dict[str, Any] = {
    "name": "contract",
    "command": ["train.py"],
    "nodes": 2,
    "procs_per_node": 2,
    "workdir": "/tmp",
    "env": {"MINE": "1"},
}
VARIANTS = {
    "plain": {},
    "signal": {"signal": "USR1", "max_requeues": 3, "host_template": "{host}-ib"},
    "no-signal": {"signal": None, "max_requeues": 0},
    "hang-bounds": {"hang_timeout_s": 90, "hang_first_timeout_s": 1200.5},
    "hang-off": {"hang_timeout_s": 0},
}


def _spec(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({**BASE, **fields})


def _sbatch_exports(spec: JobSpec) -> dict[str, str]:
    found = {}
    for line in render.render_sbatch(spec).splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            found[key] = shlex.split(value)[0] if value else ""
    return found


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sbatch_exports_the_contract(variant: str) -> None:
    spec = _spec(**VARIANTS[variant])
    expected = {"MINE": "1", **exports.exports(spec)}
    if spec.signal is not None:  # the batch script makes the latch folder at run time
        expected[contract.LATCH_DIR_VAR] = ""
    assert _sbatch_exports(spec) == expected


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_submitit_exports_the_contract(variant: str) -> None:
    needs.module("submitit")
    from ddpkit.jobs.backends.submitit import executor_parameters

    spec = _spec(**VARIANTS[variant])
    lines = executor_parameters(spec)["slurm_setup"]
    found = dict(line.removeprefix("export ").split("=", 1) for line in lines)
    expected = {"MINE": "1", **exports.exports(spec, launch="srun")}
    if spec.signal is not None:
        expected[contract.SUBMITIT_SIGNAL_VAR] = spec.signal
    assert {k: shlex.split(v)[0] for k, v in found.items()} == expected


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_torchx_carries_the_contract_stop_signal_included(variant: str) -> None:
    needs.module("torchx")
    from ddpkit.jobs.backends.torchx_appdef import spec_to_appdef

    spec = _spec(**VARIANTS[variant])
    (role,) = spec_to_appdef(spec).roles
    expected = exports.exports(spec, launch="torchrun")
    # torchx writes "$" as "$$" in env values (its macro escape)
    assert {k: role.env[k].replace("$$", "$") for k in expected} == expected
    if spec.signal is not None:  # the defect the contract fixed: torchx jobs lost these
        assert role.env[contract.SIGNAL_VAR] == spec.signal
    assert role.env[contract.MAX_REQUEUES_VAR] == str(spec.max_requeues)


@pytest.mark.parametrize("variable", [v.name for v in contract.JOB_SCRIPT])
def test_every_contract_variable_is_reserved_in_a_specs_env(variable: str) -> None:
    assert variable in contract.RESERVED_ENV
    with pytest.raises(ValidationError, match="is set by ddpkit"):
        _spec(env={variable: "x"})


def test_only_the_contract_module_spells_a_ddpkit_variable_in_code() -> None:
    """Every DDPKIT_* name is a constant of ddpkit.contract; other modules import it (prose in
    docstrings, comments and messages may still mention one)."""
    import ast
    import re
    from pathlib import Path

    src = Path(contract.__file__).parent
    found = []
    for path in sorted(src.rglob("*.py")):
        if path == Path(contract.__file__):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and re.fullmatch(r"DDPKIT_[A-Z][A-Z0-9_]*", node.value)
            ):
                found.append(f"{path.relative_to(src)}:{node.lineno} {node.value}")
    assert not found, found
