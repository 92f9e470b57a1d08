"""torchrun / torchelastic workers, torchrun-style launchers, and torchrun inside a SLURM step."""

from __future__ import annotations

import pytest

from ddpkit.cluster.detect import detect, detect_environment
from ddpkit.cluster.environments.torchrun import TorchrunEnvironment
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.errors import ConfigError, TopologyError
from tests.cluster.test_env_slurm import srun_env


def torchrun_env(rank: int, nproc: int = 4, nnodes: int = 2) -> dict[str, str]:
    """What torch.distributed.run's agent puts in a worker's environment."""
    world = nproc * nnodes
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % nproc),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(rank // nproc),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "node-a",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.parametrize("rank", range(8))
def test_torchrun_two_nodes_four_procs(rank: int) -> None:
    env = torchrun_env(rank)
    assert isinstance(detect_environment(env), TorchrunEnvironment)
    assert detect(env) == RankInfo(
        rank=rank,
        local_rank=rank % 4,
        world_size=8,
        local_world_size=4,
        node_rank=rank // 4,
        num_nodes=2,
        master_addr="node-a",
        master_port=29500,
        launcher="torchrun",
    )


def test_group_variables_win_over_arithmetic() -> None:
    # torchrun assigns GROUP_RANK at rendezvous; it need not be rank // nproc's node order.
    env = torchrun_env(1) | {"GROUP_RANK": "1"}
    info = detect(env)
    assert (info.rank, info.node_rank, info.num_nodes) == (1, 1, 2)
    env = torchrun_env(1) | {"GROUP_WORLD_SIZE": "3"}
    assert detect(env).num_nodes == 3


@pytest.mark.parametrize(
    ("ranks", "nodes"),
    [
        # (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE) -> (node_rank, num_nodes)
        ((0, 0, 8, 4), (0, 2)),
        ((5, 1, 8, 4), (1, 2)),
        ((5, 1, 6, 4), (1, 2)),  # uneven: ceil(6 / 4) nodes
        ((2, 0, 3, 1), (2, 3)),
    ],
)
def test_torchrun_style_launcher_without_group_variables(
    ranks: tuple[int, int, int, int], nodes: tuple[int, int]
) -> None:
    rank, local_rank, world, local = ranks
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local),
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "29999",
    }
    assert TorchrunEnvironment.detect(env)
    info = detect(env)
    assert (info.node_rank, info.num_nodes) == nodes
    assert (info.master_addr, info.master_port) == ("10.1.2.3", 29999)


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},  # LOCAL_WORLD_SIZE missing
        {"RANK": "0", "WORLD_SIZE": "1"},
        {"LOCAL_RANK": "0"},
    ],
)
def test_partial_torchrun_variables_are_not_torchrun(env: dict[str, str]) -> None:
    # what they are instead (torch's env:// set, or nothing) is in test_env_torchenv.py
    assert not TorchrunEnvironment.detect(env)


def test_torchelastic_run_id_requires_the_rank_variables() -> None:
    env = torchrun_env(0)
    del env["LOCAL_WORLD_SIZE"]
    assert TorchrunEnvironment.detect(env)
    with pytest.raises(ConfigError, match=r"LOCAL_WORLD_SIZE is not set"):
        detect(env)


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT"])
def test_missing_master_is_an_error_for_a_real_world(missing: str) -> None:
    env = torchrun_env(3)
    del env[missing]
    with pytest.raises(ConfigError) as caught:
        detect(env)
    assert f"{missing} is not set but WORLD_SIZE=8" in str(caught.value)
    assert "hint:" in str(caught.value)


def test_world_of_one_defaults_the_master() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    info = detect(env)
    assert (info.master_addr, info.master_port, info.launcher) == ("127.0.0.1", 29500, "torchrun")
    assert detect(env | {"MASTER_PORT": "31000"}).master_port == 31000


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("RANK", "x"),
        ("LOCAL_RANK", "0.5"),
        ("WORLD_SIZE", "8 nodes"),
        ("LOCAL_WORLD_SIZE", ""),
        ("GROUP_RANK", "one"),
        ("MASTER_PORT", "port"),
    ],
)
def test_bad_integers(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        detect(torchrun_env(1) | {variable: value})
    assert f"{variable}={value!r} is not an integer" in str(caught.value)


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"RANK": "8"}, ["RANK=8", "WORLD_SIZE=8"]),
        ({"RANK": "-1"}, ["RANK=-1", "WORLD_SIZE=8"]),
        ({"LOCAL_RANK": "4"}, ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"]),
        ({"GROUP_RANK": "2"}, ["GROUP_RANK=2", "GROUP_WORLD_SIZE=2"]),
        ({"WORLD_SIZE": "0"}, ["WORLD_SIZE=0", "at least 1"]),
        ({"LOCAL_WORLD_SIZE": "0"}, ["LOCAL_WORLD_SIZE=0", "at least 1"]),
        ({"LOCAL_WORLD_SIZE": "16"}, ["LOCAL_WORLD_SIZE=16", "WORLD_SIZE=8"]),
    ],
)
def test_out_of_range_values_are_topology_errors(changes: dict[str, str], names: list[str]) -> None:
    with pytest.raises(TopologyError) as caught:
        detect(torchrun_env(1) | changes)
    for name in names:
        assert name in str(caught.value)


# ---- torchrun inside SLURM ---------------------------------------------------------------


def test_torchrun_wins_inside_a_slurm_step_with_one_task_per_node() -> None:
    # srun --ntasks-per-node=1 torchrun --nproc-per-node 4: the worker sees both variable sets.
    env = srun_env(1, (1, 1), tasks_per_node="1(x2)") | torchrun_env(6)
    assert isinstance(detect_environment(env), TorchrunEnvironment)
    info = detect(env)
    assert (info.rank, info.world_size, info.local_world_size, info.launcher) == (
        6,
        8,
        4,
        "torchrun",
    )


def test_torchrun_under_several_srun_tasks_per_node_is_rejected() -> None:
    # srun --ntasks-per-node=2 torchrun --nproc-per-node 4: 8 processes per node claim 4 GPUs.
    env = srun_env(1, (2, 2)) | torchrun_env(1)
    with pytest.raises(TopologyError) as caught:
        detect(env)
    message = str(caught.value)
    assert "srun started 2 tasks on this node" in message
    assert "nproc 4" in message
    assert "LOCAL_WORLD_SIZE=4" in message
    assert "duplicate ranks" in message
    assert "--ntasks-per-node=1" in message


def test_launcher_copying_slurm_ranks_is_not_nesting() -> None:
    # srun bash -c 'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID ... python train.py'
    slurm = srun_env(3)
    env = slurm | {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
    }
    info = detect(env)
    assert (info.rank, info.world_size, info.local_world_size, info.node_rank) == (3, 4, 2, 1)


def test_torchrun_in_a_batch_script_is_not_checked_against_slurm() -> None:
    # No srun step: torchrun started from the batch script itself is the only launcher.
    env = {k: v for k, v in srun_env(0, (2, 2)).items() if not k.startswith("SLURM_STEP")}
    assert detect(env | torchrun_env(5)).rank == 5


def test_torchrun_with_one_proc_per_srun_task_is_accepted() -> None:
    env = srun_env(1, (2, 2)) | torchrun_env(1, nproc=1, nnodes=4)
    assert detect(env).local_world_size == 1


def test_empty_master_addr_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"MASTER_ADDR='' is empty"):
        detect(torchrun_env(0) | {"MASTER_ADDR": ""})
