"""mpirun-started processes: Open MPI, MPICH/Intel MPI (hydra) and MVAPICH variable sets."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ddpkit.cluster.detect import detect, detect_environment
from ddpkit.cluster.environments.mpi import MpiEnvironment
from ddpkit.cluster.rendezvous.ports import port_for_job
from ddpkit.errors import ConfigError, TopologyError


def openmpi_env(rank: int, size: int = 4, local_size: int = 2) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank % local_size),
        "OMPI_UNIVERSE_SIZE": str(size),
        "OMPI_MCA_ess_base_jobid": "3735552001",
        "OMPI_MCA_orte_launch": "1",
        "PMIX_RANK": str(rank),
        "PMIX_NAMESPACE": "prterun-node1-12345@1",
    }


def hydra_env(rank: int, size: int = 4, local_size: int = 2) -> dict[str, str]:
    return {
        "PMI_RANK": str(rank),
        "PMI_SIZE": str(size),
        "PMI_FD": "7",
        "MPI_LOCALRANKID": str(rank % local_size),
        "MPI_LOCALNRANKS": str(local_size),
        "HYDRA_CONTROL_FD": "9",
    }


def mvapich_env(rank: int, size: int = 4, local_size: int = 2) -> dict[str, str]:
    return {
        "MV2_COMM_WORLD_RANK": str(rank),
        "MV2_COMM_WORLD_SIZE": str(size),
        "MV2_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
        "MV2_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "MPIRUN_ID": "4711",
    }


MakeEnv = Callable[[int], dict[str, str]]
FLAVOURS: list[tuple[str, MakeEnv]] = [
    ("openmpi", openmpi_env),
    ("hydra", hydra_env),
    ("mvapich", mvapich_env),
]
MASTER = {"MASTER_ADDR": "node1", "MASTER_PORT": "23456"}


@pytest.mark.parametrize(("flavour", "make"), FLAVOURS)
@pytest.mark.parametrize("rank", range(4))
def test_two_nodes_two_ranks_each(flavour: str, make: MakeEnv, rank: int) -> None:
    env = make(rank) | MASTER
    assert MpiEnvironment.flavour(env) == flavour
    assert isinstance(detect_environment(env), MpiEnvironment)
    info = detect(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        rank,
        4,
        rank % 2,
        2,
    )
    assert (info.node_rank, info.num_nodes) == (rank // 2, 2)
    assert (info.master_addr, info.master_port, info.launcher) == ("node1", 23456, "mpi")


@pytest.mark.parametrize(
    ("env", "port"),
    [
        (openmpi_env(1, 4, 4), port_for_job("prterun-node1-12345@1")),
        (
            {k: v for k, v in openmpi_env(1, 4, 4).items() if k != "PMIX_NAMESPACE"},
            port_for_job("3735552001"),
        ),
        (mvapich_env(1, 4, 4), port_for_job("4711")),
        (hydra_env(1, 4, 4) | {"PMI_JOBID": "kvs_99"}, port_for_job("kvs_99")),
        (hydra_env(1, 4, 4), 29500),
    ],
)
def test_single_node_without_master_uses_localhost_and_a_job_port(
    env: dict[str, str], port: int
) -> None:
    info = detect(env)
    assert (info.num_nodes, info.master_addr, info.master_port) == (1, "127.0.0.1", port)


def test_master_port_alone_is_used() -> None:
    info = detect(openmpi_env(0, 2, 2) | {"MASTER_PORT": "31111"})
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 31111)


@pytest.mark.parametrize(("flavour", "make"), FLAVOURS)
def test_multi_node_without_master_addr_is_an_error(flavour: str, make: MakeEnv) -> None:
    with pytest.raises(ConfigError) as caught:
        detect(make(3))
    message = str(caught.value)
    assert "MASTER_ADDR is not set" in message
    assert "2 nodes" in message
    assert "mpirun -x MASTER_ADDR=$(hostname)" in message


def test_uneven_world_rounds_nodes_up() -> None:
    info = detect(openmpi_env(5, 6, 4) | MASTER)
    assert (info.node_rank, info.num_nodes, info.local_rank) == (1, 2, 1)


@pytest.mark.parametrize(
    ("env", "variable", "value"),
    [
        (
            openmpi_env(0) | MASTER | {"OMPI_COMM_WORLD_RANK": "zero"},
            "OMPI_COMM_WORLD_RANK",
            "zero",
        ),
        (hydra_env(0) | MASTER | {"MPI_LOCALNRANKS": "2x"}, "MPI_LOCALNRANKS", "2x"),
        (mvapich_env(0) | MASTER | {"MV2_COMM_WORLD_SIZE": ""}, "MV2_COMM_WORLD_SIZE", ""),
    ],
)
def test_bad_integers(env: dict[str, str], variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"{variable}={value!r} is not an integer"):
        detect(env)


def test_missing_local_variable_is_named() -> None:
    env = hydra_env(0) | MASTER
    del env["MPI_LOCALRANKID"]
    with pytest.raises(ConfigError, match=r"MPI_LOCALRANKID is not set"):
        detect(env)


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"OMPI_COMM_WORLD_RANK": "4"}, ["OMPI_COMM_WORLD_RANK=4", "OMPI_COMM_WORLD_SIZE=4"]),
        (
            {"OMPI_COMM_WORLD_LOCAL_RANK": "2"},
            ["OMPI_COMM_WORLD_LOCAL_RANK=2", "OMPI_COMM_WORLD_LOCAL_SIZE=2"],
        ),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "0"}, ["OMPI_COMM_WORLD_LOCAL_SIZE=0", "at least 1"]),
        ({"OMPI_COMM_WORLD_SIZE": "0"}, ["OMPI_COMM_WORLD_SIZE=0", "at least 1"]),
    ],
)
def test_out_of_range_values_are_topology_errors(changes: dict[str, str], names: list[str]) -> None:
    with pytest.raises(TopologyError) as caught:
        detect(openmpi_env(1) | MASTER | changes)
    for name in names:
        assert name in str(caught.value)
