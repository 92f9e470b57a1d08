"""The pure cross-checks in ddpkit.cluster.validate, called with plain values."""

from __future__ import annotations

from typing import Any

import pytest

from ddpkit.cluster import validate
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.errors import TopologyError

NAMES = {
    "rank": "RANK",
    "world_size": "WORLD_SIZE",
    "local_rank": "LOCAL_RANK",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "node_rank": "GROUP_RANK",
    "num_nodes": "GROUP_WORLD_SIZE",
}
GOOD_RANKS = {
    "rank": 5,
    "world_size": 8,
    "local_rank": 1,
    "local_world_size": 4,
    "node_rank": 1,
    "num_nodes": 2,
}


def check_ranks(names: dict[str, str], **ranks: int) -> RankInfo:
    info = RankInfo(**ranks, master_addr="127.0.0.1", master_port=29500, launcher="env")
    return validate.check_rank_info(info, names)


def test_consistent_ranks_pass() -> None:
    info = check_ranks(NAMES, **GOOD_RANKS)
    assert (info.rank, info.world_size) == (5, 8)
    check_ranks({}, **GOOD_RANKS)


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"rank": 8}, ["RANK=8 is outside [0, WORLD_SIZE=8)"]),
        ({"rank": -1}, ["RANK=-1 is outside [0, WORLD_SIZE=8)"]),
        ({"local_rank": 4}, ["LOCAL_RANK=4 is outside [0, LOCAL_WORLD_SIZE=4)"]),
        ({"node_rank": 2}, ["GROUP_RANK=2 is outside [0, GROUP_WORLD_SIZE=2)"]),
        ({"world_size": 0, "rank": 0}, ["WORLD_SIZE=0 must be at least 1"]),
        ({"local_world_size": 0}, ["LOCAL_WORLD_SIZE=0 must be at least 1"]),
        ({"num_nodes": 0}, ["GROUP_WORLD_SIZE=0 must be at least 1"]),
        ({"local_world_size": 9}, ["LOCAL_WORLD_SIZE=9 exceeds WORLD_SIZE=8"]),
    ],
)
def test_rank_range_errors(changes: dict[str, int], fragments: list[str]) -> None:
    with pytest.raises(TopologyError) as caught:
        check_ranks(NAMES, **(GOOD_RANKS | changes))
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert caught.value.hint


def test_field_names_are_used_when_no_variable_is_known() -> None:
    with pytest.raises(TopologyError, match=r"rank=9 is outside \[0, world_size=8\)"):
        check_ranks({}, **(GOOD_RANKS | {"rank": 9}))


GOOD_LAYOUT: dict[str, Any] = {
    "tasks_var": "SLURM_STEP_NUM_TASKS",
    "num_tasks": 5,
    "nodes_var": "SLURM_STEP_NUM_NODES",
    "num_nodes": 3,
    "tasks_per_node_var": "SLURM_STEP_TASKS_PER_NODE",
    "tasks_per_node_text": "3,1(x2)",
    "tasks_per_node": [3, 1, 1],
    "nodelist_var": "SLURM_STEP_NODELIST",
    "nodelist_text": "n[1-3]",
    "num_hosts": 3,
}


def test_consistent_slurm_layout_passes() -> None:
    validate.check_slurm_layout(**GOOD_LAYOUT)
    validate.check_slurm_layout(**(GOOD_LAYOUT | {"num_hosts": None}))


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        (
            {"num_tasks": 6},
            ["SLURM_STEP_TASKS_PER_NODE='3,1(x2)' adds up to 5 tasks", "SLURM_STEP_NUM_TASKS=6"],
        ),
        (
            {"tasks_per_node_text": "4,1", "tasks_per_node": [4, 1], "num_tasks": 5},
            ["SLURM_STEP_TASKS_PER_NODE='4,1' describes 2 nodes", "SLURM_STEP_NUM_NODES=3"],
        ),
        (
            {"num_hosts": 4, "nodelist_text": "n[1-4]"},
            ["SLURM_STEP_NODELIST='n[1-4]' names 4 hosts", "SLURM_STEP_NUM_NODES=3"],
        ),
    ],
)
def test_slurm_layout_errors(changes: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(TopologyError) as caught:
        validate.check_slurm_layout(**(GOOD_LAYOUT | changes))
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert "unset the SLURM_* variables" in str(caught.value)


NESTING: dict[str, int] = {
    "srun_tasks_on_node": 2,
    "nproc_per_node": 4,
    "torchrun_rank": 1,
    "torchrun_world_size": 8,
    "slurm_procid": 1,
    "slurm_num_tasks": 4,
}


@pytest.mark.parametrize(
    ("changes", "ok"),
    [
        ({}, False),
        ({"srun_tasks_on_node": 1}, True),
        ({"nproc_per_node": 1}, True),
        ({"torchrun_world_size": 4}, True),  # same rank and world as SLURM: copied, not nested
        ({"torchrun_world_size": 4, "torchrun_rank": 2}, False),
    ],
)
def test_torchrun_in_slurm(changes: dict[str, int], ok: bool) -> None:
    if ok:
        validate.check_torchrun_in_slurm(**(NESTING | changes))
        return
    with pytest.raises(TopologyError) as caught:
        validate.check_torchrun_in_slurm(**(NESTING | changes))
    message = str(caught.value)
    assert "srun started 2 tasks on this node" in message
    assert "nproc 4" in message
    assert "duplicate ranks / GPUs" in message
    assert "--ntasks-per-node=1" in message
    assert "one task per process" in message


STRAY: dict[str, Any] = {
    "stray_rank": None,
    "stray_world_size": None,
    "rank_var": "SLURM_PROCID",
    "rank": 3,
    "world_size_var": "SLURM_STEP_NUM_TASKS",
    "world_size": 4,
}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"stray_rank": "3"},
        {"stray_world_size": "4"},
        {"stray_rank": " 3", "stray_world_size": "4"},
    ],
)
def test_agreeing_stray_variables_pass(changes: dict[str, Any]) -> None:
    validate.check_stray_torch_vars(**(STRAY | changes))


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"stray_world_size": "8"}, ["WORLD_SIZE='8' contradicts SLURM_STEP_NUM_TASKS=4"]),
        ({"stray_rank": "0"}, ["RANK='0' contradicts SLURM_PROCID=3", "unset RANK"]),
        ({"stray_rank": "three"}, ["RANK='three' contradicts SLURM_PROCID=3"]),
    ],
)
def test_contradicting_stray_variables(changes: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(TopologyError) as caught:
        validate.check_stray_torch_vars(**(STRAY | changes))
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_check_index() -> None:
    validate.check_index("SLURM_NODEID", 1, "SLURM_NNODES", 2)
    with pytest.raises(TopologyError, match=r"SLURM_NODEID=2 is outside \[0, SLURM_NNODES=2\)"):
        validate.check_index("SLURM_NODEID", 2, "SLURM_NNODES", 2)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), (" TRUE ", True), ("on", True), ("0", False), ("No", False), ("", None)],
)
def test_env_bool_reads_the_usual_spellings(raw: str, expected: bool | None) -> None:
    from ddpkit.cluster.envvars import env_bool

    assert env_bool({"X": raw}, "X", hint="h") is expected
    assert env_bool({}, "X", hint="h") is None


def test_env_bool_names_the_variable_and_value_of_anything_else() -> None:
    from ddpkit.cluster.envvars import env_bool
    from ddpkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"X='maybe' is not a boolean") as caught:
        env_bool({"X": "maybe"}, "X", hint="set X=1 or X=0")
    assert caught.value.hint == "set X=1 or X=0"
