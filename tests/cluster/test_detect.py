"""The detection entry point: order, fallback, purity, and the import-without-torch promise."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import MappingProxyType

import pytest

import ddpkit
from ddpkit.cluster import detect as detect_from_package
from ddpkit.cluster import detect_environment as detect_environment_from_package
from ddpkit.cluster.detect import DETECTION_ORDER, detect, detect_environment
from ddpkit.cluster.environments.base import ClusterEnvironment
from ddpkit.cluster.environments.mpi import MpiEnvironment
from ddpkit.cluster.environments.single import SingleEnvironment
from ddpkit.cluster.environments.slurm import SlurmEnvironment
from ddpkit.cluster.environments.submitit import SubmititEnvironment
from ddpkit.cluster.environments.torchenv import TorchEnvEnvironment
from ddpkit.cluster.environments.torchrun import TorchrunEnvironment
from ddpkit.cluster.rankinfo import ANY_PORT
from tests.cluster.test_env_mpi import hydra_env, openmpi_env
from tests.cluster.test_env_slurm import BATCH_ENV, srun_env
from tests.cluster.test_env_submitit import local_env
from tests.cluster.test_env_torchrun import torchrun_env

# Where the ddpkit under test lives (src/ checkout or site-packages), for child interpreters.
SRC = Path(ddpkit.__file__).resolve().parents[1]


def test_detection_order_is_one_tuple_with_single_last() -> None:
    assert (
        TorchrunEnvironment,
        SubmititEnvironment,
        SlurmEnvironment,
        MpiEnvironment,
        TorchEnvEnvironment,
        SingleEnvironment,
    ) == DETECTION_ORDER
    assert all(issubclass(env, ClusterEnvironment) for env in DETECTION_ORDER)
    assert [env.launcher for env in DETECTION_ORDER] == [
        "torchrun",
        "submitit",
        "slurm",
        "mpi",
        "env",
        "single",
    ]


def test_package_exports_the_entry_points() -> None:
    assert detect_from_package is detect
    assert detect_environment_from_package is detect_environment


@pytest.mark.parametrize(
    ("env", "environment"),
    [
        ({}, SingleEnvironment),
        ({"HOME": "/root", "PATH": "/usr/bin"}, SingleEnvironment),
        (torchrun_env(0), TorchrunEnvironment),
        # torchrun runs inside SLURM steps: its variables describe the worker.
        (srun_env(0, (1, 1), tasks_per_node="1(x2)") | torchrun_env(0), TorchrunEnvironment),
        (srun_env(0) | {"SUBMITIT_EXECUTOR": "slurm"}, SubmititEnvironment),
        (local_env(0), SubmititEnvironment),
        (srun_env(0), SlurmEnvironment),
        (BATCH_ENV, SlurmEnvironment),
        (openmpi_env(0), MpiEnvironment),
        (hydra_env(0), MpiEnvironment),
        # mpirun inside an allocation: the SLURM variables describe mpirun's daemon step.
        (srun_env(0, (1, 1), tasks_per_node="1(x2)") | openmpi_env(3), MpiEnvironment),
        (BATCH_ENV | hydra_env(1), MpiEnvironment),
        (BATCH_ENV | {"MV2_COMM_WORLD_SIZE": "4"}, MpiEnvironment),
        # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE for real SLURM tasks: SLURM stays in charge.
        (srun_env(2) | {"PMI_RANK": "2", "PMI_SIZE": "4", "PMI_FD": "5"}, SlurmEnvironment),
        # SLURM_PROCID alone (no job id) is not a SLURM task.
        ({"SLURM_PROCID": "0"}, SingleEnvironment),
        # torch's env:// variables without torchrun's: their own environment, not a world
        # of one; in an srun step SLURM stays in charge (and checks them), in a batch script
        # (mp.spawn, a hand-written loop) they describe the processes.
        ({"RANK": "1", "WORLD_SIZE": "2"}, TorchEnvEnvironment),
        ({"WORLD_SIZE": "2"}, TorchEnvEnvironment),
        (srun_env(0) | {"RANK": "0", "WORLD_SIZE": "4"}, SlurmEnvironment),
        (BATCH_ENV | {"RANK": "1", "WORLD_SIZE": "2"}, TorchEnvEnvironment),
        (BATCH_ENV | {"SLURM_STEP_ID": "x", "RANK": "1"}, SlurmEnvironment),  # SLURM names it
        (openmpi_env(1) | {"RANK": "1", "WORLD_SIZE": "2"}, MpiEnvironment),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "29500"}, SingleEnvironment),  # no world size
        ({"LOCAL_RANK": "0"}, SingleEnvironment),
    ],
)
def test_detect_environment_picks_by_order(
    env: dict[str, str], environment: type[ClusterEnvironment]
) -> None:
    assert type(detect_environment(env)) is environment


def test_mpirun_inside_an_allocation_gets_mpi_ranks() -> None:
    env = srun_env(1, (1, 1), tasks_per_node="1(x2)") | openmpi_env(3) | {"MASTER_ADDR": "n1"}
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size) == ("mpi", 3, 4)


@pytest.mark.parametrize("env", [{}, {"LANG": "C.UTF-8"}])
def test_empty_environment_is_a_single_process(env: dict[str, str]) -> None:
    info = detect(env)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (0, 0, 1, 1)
    assert (info.node_rank, info.num_nodes, info.launcher) == (0, 1, "single")
    assert (info.master_addr, info.master_port) == ("127.0.0.1", ANY_PORT)  # init() picks it
    assert info.notes == ()
    assert not info.is_distributed


# Audits the process's socket calls, file opens and subprocesses (CPython's audit hooks: the
# real calls, nothing patched), then detects and prints before init() as a script would, often.
_NO_IO = """
import sys
import ddpkit
from ddpkit.cluster.detect import detect
say = ddpkit.print  # imports ddpkit.worker.rankzero (a module import opens files)
events = []
sys.addaudithook(
    lambda event, args: events.append(event)
    if event.startswith(("socket.", "open", "subprocess.")) else None
)
infos = {detect() for _ in range(100)}
for i in range(50):
    say("line", i, file=sys.stderr)
print(len(infos), next(iter(infos)).launcher, events)
"""


@pytest.mark.parametrize("env", [{}, BATCH_ENV], ids=["plain", "slurm-batch-script"])
def test_detection_and_print_before_init_do_no_io(env: dict[str, str]) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    done = subprocess.run(
        [sys.executable, "-c", _NO_IO], env=clean | env, capture_output=True, text=True, check=True
    )
    assert done.stdout == "1 single []\n", done.stdout  # one RankInfo, no socket, no file
    assert done.stderr.count("line") == 50


def test_single_process_keeps_master_port() -> None:
    assert detect({"MASTER_PORT": "24680"}).master_port == 24680


def test_single_process_rejects_a_bad_master_port() -> None:
    with pytest.raises(ValueError, match=r"MASTER_PORT='abc' is not an integer"):
        detect({"MASTER_PORT": "abc"})


@pytest.mark.parametrize(
    "env",
    [{}, torchrun_env(2), srun_env(3), BATCH_ENV, local_env(1), openmpi_env(0, 2, 2)],
)
def test_detection_is_pure(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    original = dict(env)
    before = dict(os.environ)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        detect(env)
        detect(MappingProxyType(env))
    assert env == original
    assert dict(os.environ) == before
    assert capsys.readouterr() == ("", "")


def test_environment_keeps_a_snapshot() -> None:
    env = torchrun_env(1)
    environment = detect_environment(env)
    env["RANK"] = "7"
    assert environment.rank_info().rank == 1
    with pytest.raises(TypeError):
        environment.env["RANK"] = "3"  # type: ignore[index]


def test_default_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun variables win over anything else the test runner's environment may hold.
    for name, value in torchrun_env(6).items():
        monkeypatch.setenv(name, value)
    info = detect()
    assert (info.launcher, info.rank, info.world_size) == ("torchrun", 6, 8)
    assert isinstance(detect_environment(), TorchrunEnvironment)
    assert os.environ["RANK"] == "6"


def test_importing_the_cluster_package_does_not_import_torch() -> None:
    code = (
        "import ddpkit.cluster, ddpkit.cluster.detect, ddpkit.cluster.validate, sys\n"
        "import ddpkit.cluster.environments.slurm, ddpkit.cluster.environments.mpi\n"
        "ddpkit.cluster.detect({})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_single_process_ignores_master_addr() -> None:
    info = detect({"MASTER_ADDR": "some-old-head-node", "MASTER_PORT": "24680"})
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 24680)
