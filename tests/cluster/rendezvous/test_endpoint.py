"""``python -m ddpkit.cluster.rendezvous.endpoint``: the c10d host:port inside a SLURM job."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ddpkit.cluster.rendezvous.endpoint import endpoint, hosts_store, main
from ddpkit.cluster.rendezvous.ports import port_for_job
from ddpkit.errors import ConfigError

JOB_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[07-09],gpu-b1"}
AUTO = port_for_job("4242", "rdzv")


@pytest.mark.parametrize(
    ("env", "port", "expected"),
    [
        (JOB_ENV, "auto", f"gpu-a07:{AUTO}"),
        (JOB_ENV, "29400", "gpu-a07:29400"),
        (JOB_ENV | {"DDPKIT_HOST_TEMPLATE": "{host}-ib"}, "auto", f"gpu-a07-ib:{AUTO}"),
        ({"SLURM_JOBID": "4242", "SLURM_NODELIST": "n1"}, "auto", f"n1:{AUTO}"),
        ({"SLURM_JOB_NODELIST": "n[1-2]"}, "1234", "n1:1234"),  # no job id needed
        ({"SLURM_JOB_NODELIST": "fe80::1"}, "1234", "[fe80::1]:1234"),
        (JOB_ENV | {"SLURM_JOB_ID": "4243"}, "auto", f"gpu-a07:{port_for_job('4243', 'rdzv')}"),
    ],
)
def test_endpoint(env: dict[str, str], port: str, expected: str) -> None:
    assert endpoint(env, port) == expected
    assert port_for_job("4242") != AUTO  # apart from the srun steps' MASTER_PORT


IB = JOB_ENV | {"DDPKIT_HOST_TEMPLATE": "{host}-ib"}


# (environment of the node's `ddpkit run`, its --rdzv-endpoint, hosts the store?)
HOSTS_STORE: list[tuple[dict[str, str], str, bool | None]] = [
    # the endpoint the job script computes: the first node hosts, explicitly, the others do not
    (IB | {"SLURMD_NODENAME": "gpu-a07"}, f"gpu-a07-ib:{AUTO}", True),
    (IB | {"SLURMD_NODENAME": "gpu-a08"}, f"gpu-a07-ib:{AUTO}", False),
    (IB | {"SLURMD_NODENAME": "gpu-b1"}, "gpu-a07-ib:29400", False),
    (JOB_ENV | {"SLURMD_NODENAME": "gpu-a07"}, "gpu-a07:29400", True),
    (JOB_ENV | {"SLURMD_NODENAME": "gpu-a09"}, "gpu-a07", False),
    (
        {"SLURM_NODELIST": "fe80::1", "SLURMD_NODENAME": "fe80::1"},
        "[fe80::1]:1234",
        True,
    ),
    # any other endpoint, or outside a SLURM job: torch's own guess stands
    (IB | {"SLURMD_NODENAME": "gpu-a07"}, "gpu-a07:29400", None),  # not templated
    (IB | {"SLURMD_NODENAME": "gpu-a07"}, "head.example:29400", None),
    (IB | {"SLURMD_NODENAME": "gpu-a07"}, "", None),
    (IB, f"gpu-a07-ib:{AUTO}", None),  # no SLURMD_NODENAME: not in a job step
    ({"SLURMD_NODENAME": "gpu-a07"}, "gpu-a07:29400", None),  # no nodelist
]


@pytest.mark.parametrize(("env", "rdzv_endpoint", "expected"), HOSTS_STORE)
def test_hosts_store(env: dict[str, str], rdzv_endpoint: str, expected: bool | None) -> None:
    host, _ = parse_rendezvous_endpoint(rdzv_endpoint, 0)  # as ddpkit run reads its endpoint
    assert hosts_store(env, host) is expected


@pytest.mark.parametrize(
    ("env", "port", "message"),
    [
        ({}, "auto", "SLURM_JOB_NODELIST / SLURM_NODELIST is not set"),
        ({"SLURM_JOB_NODELIST": "n[1-2"}, "auto", "SLURM_JOB_NODELIST='n[1-2' is malformed"),
        ({"SLURM_JOB_NODELIST": "n1"}, "auto", "SLURM_JOB_ID / SLURM_JOBID is not set"),
        (JOB_ENV, "70000", "--port='70000' is not a TCP port"),
        (JOB_ENV, "http", "--port='http' is not an integer"),
        (JOB_ENV | {"DDPKIT_HOST_TEMPLATE": "ib"}, "auto", "does not contain '{host}'"),
    ],
)
def test_endpoint_errors(
    env: dict[str, str], port: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        endpoint(env, port)
    assert caught.value.hint
    assert main(["--port", port], env) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("python -m ddpkit.cluster.rendezvous.endpoint: error: ")
    assert message in err
    assert err.count("\n") == 1


def test_endpoint_module_runs_without_heavy_imports() -> None:
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8"} | JOB_ENV
    command = [sys.executable, "-m", "ddpkit.cluster.rendezvous.endpoint"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"gpu-a07:{AUTO}\n", "")
    bad = subprocess.run(command, env={}, capture_output=True, text=True, check=False)
    assert (bad.returncode, bad.stdout) == (2, "")
    assert "SLURM_JOB_NODELIST" in bad.stderr
    heavy = "{'torch', 'pydantic', 'jinja2'}"
    code = (
        f"import ddpkit.cluster.rendezvous.endpoint, sys; print(sorted({heavy} & set(sys.modules)))"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert probe.stdout == "[]\n"
