"""The old ``python -m`` paths of the rendezvous helpers still run, and print what the new do.

Job scripts rendered before the move to ``ddpkit.cluster.rendezvous`` call
``python -m ddpkit.jobs.endpoint`` / ``ddpkit.jobs.resv_ports`` (and torchx app definitions
``from ddpkit.cluster.ports import port_for_job``); a requeued job re-runs its old script
against the installed ddpkit, so each old path must keep answering exactly as the new one.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.cluster.rendezvous.ports import port_for_job
from tests.fakes.slurm import FakeTools

JOB_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[07-09],gpu-b1"}


def _run(module: str, args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, check=False
    )
    return done.returncode, done.stdout, done.stderr


def _base_env(path: str | None = None) -> dict[str, str]:
    return {"PATH": path or os.environ["PATH"], "LANG": "C.UTF-8"}


@pytest.mark.parametrize(
    ("env", "args"),
    [
        (JOB_ENV, []),
        (JOB_ENV, ["--port", "29400"]),
        (JOB_ENV | {"DDPKIT_HOST_TEMPLATE": "{host}-ib"}, ["--port", "auto"]),
        ({}, []),  # outside a job: exit 2, one line on stderr
    ],
)
def test_old_endpoint_path_prints_what_the_new_one_prints(
    env: dict[str, str], args: list[str]
) -> None:
    new = _run("ddpkit.cluster.rendezvous.endpoint", args, _base_env() | env)
    old = _run("ddpkit.jobs.endpoint", args, _base_env() | env)
    assert old == new
    assert new[0] == (2 if not env else 0)
    if env == JOB_ENV and not args:
        assert new[1] == f"gpu-a07:{port_for_job('4242', 'rdzv')}\n"


@pytest.mark.parametrize(
    ("config", "flag"),
    [
        ("MpiParams               = ports=12000-12999\n", "--resv-ports=1"),
        ("MpiDefault = none\n", ""),
    ],
)
def test_old_resv_ports_path_prints_what_the_new_one_prints(
    tmp_path: Path, config: str, flag: str
) -> None:
    tools = FakeTools(tmp_path)  # the one tool the probe calls: `scontrol show config`
    tools.scontrol_config(config)
    env = _base_env(tools.path())
    new = _run("ddpkit.cluster.rendezvous.resv_ports", [], env)
    assert new == (0, f"{flag}\n", "")
    assert _run("ddpkit.jobs.resv_ports", [], env) == new


def test_old_torchx_port_import_gives_the_same_port() -> None:
    code = "from ddpkit.cluster.ports import port_for_job; print(port_for_job('7', 'rdzv'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == f"{port_for_job('7', 'rdzv')}\n"


@pytest.mark.parametrize("module", ["ddpkit.jobs.endpoint", "ddpkit.jobs.resv_ports"])
def test_old_entry_points_define_nothing_when_imported(module: str) -> None:
    names = {name for name in vars(importlib.import_module(module)) if not name.startswith("__")}
    assert names <= {"annotations"}
