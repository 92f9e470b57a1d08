"""submitit jobs: its SLURM executor (SLURM arithmetic, launcher "submitit") and local executor."""

from __future__ import annotations

import dataclasses

import pytest

from ddpkit.cluster.detect import detect, detect_environment
from ddpkit.cluster.environments.submitit import SubmititEnvironment
from ddpkit.cluster.rendezvous.ports import port_for_job
from ddpkit.errors import ConfigError, TopologyError
from tests.cluster.test_env_slurm import srun_env


def local_env(rank: int, ntasks: int = 2) -> dict[str, str]:
    """The variables of submitit's LocalExecutor for task ``rank`` (submitit/local/local.py)."""
    return {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_NTASKS": str(ntasks),
        "SUBMITIT_LOCAL_COMMAND": "python -u -m submitit.core._submit /tmp/jobs",
        "SUBMITIT_LOCAL_TIMEOUT_S": "120",
        "SUBMITIT_LOCAL_SIGNAL_DELAY_S": "30",
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_LOCALID": str(rank),
        "SUBMITIT_LOCAL_GLOBALID": str(rank),
        "SUBMITIT_LOCAL_JOB_ID": "31337",
        "CUDA_AVAILABLE_DEVICES": "",
    }


@pytest.mark.parametrize("procid", range(5))
def test_slurm_executor_uses_slurm_arithmetic(procid: int) -> None:
    slurm = srun_env(procid, (3, 1, 1), nodelist="n[1-3]", tasks_per_node="3,1(x2)")
    env = slurm | {"SUBMITIT_EXECUTOR": "slurm"}
    assert isinstance(detect_environment(env), SubmititEnvironment)
    info = detect(env)
    assert info.launcher == "submitit"
    assert dataclasses.replace(info, launcher="slurm") == detect(slurm)


def test_slurm_executor_without_slurm_variables_is_not_submitit() -> None:
    assert not SubmititEnvironment.detect({"SUBMITIT_EXECUTOR": "slurm"})
    assert detect({"SUBMITIT_EXECUTOR": "slurm"}).launcher == "single"


def test_slurm_executor_checks_like_slurm() -> None:
    env = srun_env(0) | {"SUBMITIT_EXECUTOR": "slurm", "SLURM_STEP_TASKS_PER_NODE": "3,2"}
    with pytest.raises(TopologyError, match=r"SLURM_STEP_TASKS_PER_NODE='3,2' adds up to 5"):
        detect(env)


@pytest.mark.parametrize("rank", range(3))
def test_local_executor(rank: int) -> None:
    env = local_env(rank, ntasks=3)
    assert isinstance(detect_environment(env), SubmititEnvironment)
    info = detect(env)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (
        rank,
        rank,
        3,
        3,
    )
    assert (info.node_rank, info.num_nodes, info.launcher) == (0, 1, "submitit")
    assert (info.master_addr, info.master_port) == ("127.0.0.1", port_for_job("31337"))


def test_local_executor_honours_master_variables() -> None:
    info = detect(local_env(1) | {"MASTER_ADDR": "localhost", "MASTER_PORT": "25000"})
    assert (info.master_addr, info.master_port) == ("localhost", 25000)


@pytest.mark.parametrize("missing", ["SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_JOB_ID"])
def test_local_executor_missing_variables_are_named(missing: str) -> None:
    env = local_env(0)
    del env[missing]
    with pytest.raises(ConfigError, match=rf"{missing} is not set"):
        detect(env)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"SUBMITIT_LOCAL_GLOBALID": "two"}, "SUBMITIT_LOCAL_GLOBALID='two' is not an integer"),
        ({"SUBMITIT_LOCAL_GLOBALID": "2"}, "SUBMITIT_LOCAL_GLOBALID=2 is outside"),
        ({"SUBMITIT_LOCAL_LOCALID": "5"}, "SUBMITIT_LOCAL_LOCALID=5 is outside"),
        ({"SUBMITIT_LOCAL_NODEID": "1"}, "SUBMITIT_LOCAL_NODEID=1 is outside"),
    ],
)
def test_local_executor_bad_values(changes: dict[str, str], message: str) -> None:
    with pytest.raises((ConfigError, TopologyError)) as caught:
        detect(local_env(0) | changes)
    assert message in str(caught.value)


@pytest.mark.parametrize("executor", ["debug", "", "SLURM"])
def test_other_executors_are_not_submitit(executor: str) -> None:
    assert not SubmititEnvironment.detect({"SUBMITIT_EXECUTOR": executor})
