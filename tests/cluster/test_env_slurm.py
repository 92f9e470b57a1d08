"""SLURM detection from the variables srun and sbatch really set, as plain dicts.

``srun_env`` rebuilds the full variable set of one srun task (step and job level); the batch
script tables mirror what a script sees before any srun.
"""

from __future__ import annotations

import pytest

from ddpkit.cluster.detect import detect, detect_environment
from ddpkit.cluster.environments.slurm import SlurmEnvironment, in_slurm_step
from ddpkit.cluster.nodelist import expand_tasks_per_node
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.cluster.rendezvous.ports import PORT_RANGE_END, PORT_RANGE_START, port_for_job
from ddpkit.errors import ConfigError, NodelistError, TopologyError

JOB_ID = "4242"


def srun_env(
    procid: int,
    layout: tuple[int, ...] = (2, 2),
    *,
    nodelist: str = "n[1-2]",
    tasks_per_node: str = "2(x2)",
    step_id: str = "0",
    job_id: str = JOB_ID,
) -> dict[str, str]:
    """The SLURM variables of task ``procid`` of ``srun`` with a block layout ``layout``."""
    node, first = 0, 0
    while procid >= first + layout[node]:
        first += layout[node]
        node += 1
    ntasks, nnodes = str(sum(layout)), str(len(layout))
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOBID": job_id,
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": nnodes,
        "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
        "SLURM_JOB_PARTITION": "gpu",
        "SLURM_CLUSTER_NAME": "hpc",
        "SLURM_SUBMIT_DIR": "/home/user",
        "SLURM_NODELIST": nodelist,
        "SLURM_NNODES": nnodes,
        "SLURM_NTASKS": ntasks,
        "SLURM_NPROCS": ntasks,
        "SLURM_TASKS_PER_NODE": tasks_per_node,
        "SLURM_STEP_ID": step_id,
        "SLURM_STEPID": step_id,
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": nnodes,
        "SLURM_STEP_NUM_TASKS": ntasks,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_STEP_LAUNCHER_PORT": "41234",
        "SLURM_SRUN_COMM_HOST": "10.0.0.1",
        "SLURM_DISTRIBUTION": "block",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid - first),
        "SLURM_NODEID": str(node),
        "SLURM_GTIDS": ",".join(str(first + i) for i in range(layout[node])),
        "SLURM_CPUS_ON_NODE": "8",
        "SLURM_TASK_PID": "31337",
        "SLURMD_NODENAME": f"n{node + 1}",
    }


# What a batch script sees before any srun: the job's counts, but it is task 0 of no step.
BATCH_ENV = {
    "SLURM_JOB_ID": JOB_ID,
    "SLURM_JOBID": JOB_ID,
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODELIST": "n[1-2]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_GTIDS": "0",
    "SLURM_CPUS_ON_NODE": "8",
    "SLURMD_NODENAME": "n1",
}


def expected(rank: int, local_rank: int, local: int, node: int) -> RankInfo:
    """Task ``rank`` of the 2 nodes x 2 tasks step on n[1-2]."""
    return RankInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=4,
        local_world_size=local,
        node_rank=node,
        num_nodes=2,
        master_addr="n1",
        master_port=port_for_job(JOB_ID, "0"),
        launcher="slurm",
    )


@pytest.mark.parametrize(
    ("procid", "want"),
    [
        (0, expected(0, 0, 2, 0)),
        (1, expected(1, 1, 2, 0)),
        (2, expected(2, 0, 2, 1)),
        (3, expected(3, 1, 2, 1)),
    ],
)
def test_two_nodes_two_tasks_each(procid: int, want: RankInfo) -> None:
    env = srun_env(procid)
    assert isinstance(detect_environment(env), SlurmEnvironment)
    assert detect(env) == want


@pytest.mark.parametrize(
    ("procid", "local_rank", "local_world_size", "node_rank"),
    [(0, 0, 3, 0), (1, 1, 3, 0), (2, 2, 3, 0), (3, 0, 1, 1), (4, 0, 1, 2)],
)
def test_uneven_layout_gives_each_node_its_own_local_world(
    procid: int, local_rank: int, local_world_size: int, node_rank: int
) -> None:
    env = srun_env(procid, (3, 1, 1), nodelist="n[1-3]", tasks_per_node="3,1(x2)")
    info = detect(env)
    assert (info.rank, info.world_size, info.num_nodes) == (procid, 5, 3)
    assert (info.local_rank, info.local_world_size, info.node_rank) == (
        local_rank,
        local_world_size,
        node_rank,
    )


def test_single_task_step() -> None:
    info = detect(srun_env(0, (1,), nodelist="gpu07", tasks_per_node="1"))
    assert (info.world_size, info.local_world_size, info.num_nodes) == (1, 1, 1)
    assert (info.master_addr, info.launcher) == ("gpu07", "slurm")


def test_step_variables_win_over_job_variables() -> None:
    # A 2-task step on n3 inside a 4-node, 8-task allocation.
    env = srun_env(1, (2,), nodelist="n3", tasks_per_node="2") | {
        "SLURM_NTASKS": "8",
        "SLURM_NNODES": "4",
        "SLURM_NODELIST": "n[1-4]",
        "SLURM_TASKS_PER_NODE": "2(x4)",
    }
    info = detect(env)
    assert (info.world_size, info.num_nodes, info.local_world_size) == (2, 1, 2)
    assert info.master_addr == "n3"


def test_job_level_variables_are_the_fallback() -> None:
    env = {k: v for k, v in srun_env(3).items() if not k.startswith("SLURM_STEP_")}
    env["SLURM_STEP_ID"] = "0"
    info = detect(env)
    assert (info.rank, info.world_size, info.num_nodes, info.node_rank) == (3, 4, 2, 1)
    assert info.master_addr == "n1"


def test_slurm_nodelist_is_used_before_the_job_nodelist() -> None:
    env = srun_env(0) | {"SLURM_JOB_NODELIST": "a[1-2]"}
    del env["SLURM_STEP_NODELIST"]
    assert detect(env).master_addr == "n1"


def test_every_task_agrees_on_the_master() -> None:
    infos = [
        detect(srun_env(p, (4, 4), nodelist="gpu[07-08]", tasks_per_node="4(x2)")) for p in range(8)
    ]
    assert {(i.master_addr, i.master_port) for i in infos} == {("gpu07", port_for_job(JOB_ID, "0"))}
    assert PORT_RANGE_START <= infos[0].master_port <= PORT_RANGE_END


def test_steps_of_one_job_get_different_ports() -> None:
    ports = {detect(srun_env(0, step_id=str(step))).master_port for step in range(5)}
    assert len(ports) == 5


def test_master_variables_override_the_derived_master() -> None:
    env = srun_env(2) | {"MASTER_ADDR": "head.example", "MASTER_PORT": "12345"}
    info = detect(env)
    assert (info.master_addr, info.master_port) == ("head.example", 12345)


@pytest.mark.parametrize(
    ("nodelist", "layout", "first", "template", "master"),
    [
        ("n[1-2]", "2(x2)", "n1", "{host}-ib", "n1-ib"),
        ("gpu-a[07-08],gpu-b1", "2,1(x2)", "gpu-a07", "{host}.ib.cluster", "gpu-a07.ib.cluster"),
        ("rack[2-3]-node[09-10]", "1(x4)", "rack2-node09", "ib-{host}", "ib-rack2-node09"),
    ],
)
def test_host_template_applies_to_the_derived_master(
    nodelist: str, layout: str, first: str, template: str, master: str
) -> None:
    counts = tuple(expand_tasks_per_node(layout))
    env = srun_env(0, counts, nodelist=nodelist, tasks_per_node=layout)
    assert detect(env).master_addr == first
    assert detect(env | {"DDPKIT_HOST_TEMPLATE": template}).master_addr == master


def test_host_template_does_not_touch_an_explicit_master_addr() -> None:
    env = srun_env(0) | {"DDPKIT_HOST_TEMPLATE": "{host}-ib", "MASTER_ADDR": "head"}
    assert detect(env).master_addr == "head"


@pytest.mark.parametrize("template", ["n1-ib", "", "{hostname}-ib", "{}-ib"])
def test_host_template_without_placeholder_is_rejected(template: str) -> None:
    with pytest.raises(ConfigError) as caught:
        detect(srun_env(0) | {"DDPKIT_HOST_TEMPLATE": template})
    assert f"DDPKIT_HOST_TEMPLATE={template!r}" in str(caught.value)
    assert "{host}" in str(caught.value)


# ---- the batch script: one process, whatever SLURM_NTASKS says --------------------------


@pytest.mark.parametrize(
    "step",
    [
        None,  # Slurm does not set SLURM_STEP_ID in the batch step
        "4294967291",  # SLURM_BATCH_SCRIPT (0xfffffffb), Slurm >= 20.11
        "4294967292",  # SLURM_EXTERN_CONT (0xfffffffc)
        "4294967290",  # SLURM_INTERACTIVE_STEP (0xfffffffa), salloc's shell
        "4294967294",  # SLURM_BATCH_SCRIPT before 20.11 (0xfffffffe)
        "4294967295",  # SLURM_EXTERN_CONT before 20.11 (0xffffffff)
    ],
)
def test_batch_script_is_a_single_process_with_a_note(step: str | None) -> None:
    env = BATCH_ENV if step is None else BATCH_ENV | {"SLURM_STEP_ID": step}
    environment = detect_environment(env)
    assert isinstance(environment, SlurmEnvironment)
    assert not in_slurm_step(env)
    info = detect(env)
    assert (info.rank, info.world_size, info.local_world_size, info.num_nodes) == (0, 1, 1, 1)
    assert (info.launcher, info.master_addr) == ("single", "127.0.0.1")
    assert info.master_port == 0  # ANY_PORT: ddpkit.init picks a free one, detection does no I/O
    (note,) = info.notes
    assert "SLURM_NTASKS=4" in note
    assert "srun python" in note
    assert "ddpkit run" in note
    assert ("SLURM_STEP_ID is not set" in note) if step is None else (step in note)


def test_batch_script_of_a_one_task_job_has_no_note() -> None:
    env = BATCH_ENV | {"SLURM_NTASKS": "1", "SLURM_NPROCS": "1"}
    info = detect(env)
    assert (info.launcher, info.world_size, info.notes) == ("single", 1, ())


def test_batch_script_keeps_master_port() -> None:
    assert detect(BATCH_ENV | {"MASTER_PORT": "23456"}).master_port == 23456


@pytest.mark.parametrize("step", ["0", "1", "17"])
def test_real_steps_are_not_batch(step: str) -> None:
    assert detect(srun_env(0, step_id=step)).launcher == "slurm"


# ---- bad values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SLURM_PROCID", "abc"),
        ("SLURM_LOCALID", "1.0"),
        ("SLURM_NODEID", ""),
        ("SLURM_STEP_NUM_TASKS", "four"),
        ("SLURM_STEP_NUM_NODES", "2 "),
        ("SLURM_STEP_ID", "x"),
    ],
)
def test_bad_integers_name_the_variable_and_value(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        detect(srun_env(1) | {variable: value})
    assert f"{variable}={value!r} is not an integer" in str(caught.value)
    assert "hint:" in str(caught.value)


def test_bad_batch_ntasks_is_reported() -> None:
    with pytest.raises(ConfigError, match=r"SLURM_NTASKS='4x' is not an integer"):
        detect(BATCH_ENV | {"SLURM_NTASKS": "4x"})


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SLURM_STEP_TASKS_PER_NODE", "2(x", r"SLURM_STEP_TASKS_PER_NODE='2\(x' is malformed"),
        ("SLURM_STEP_NODELIST", "n[1-2", r"SLURM_STEP_NODELIST='n\[1-2' is malformed"),
    ],
)
def test_malformed_layouts_name_the_variable(variable: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        detect(srun_env(0) | {variable: value})


def test_malformed_nodelist_is_a_nodelist_error() -> None:
    with pytest.raises(NodelistError):
        detect(srun_env(0) | {"SLURM_STEP_NODELIST": "n[2-1]"})


def test_missing_tasks_per_node_names_both_variables() -> None:
    env = srun_env(0)
    del env["SLURM_STEP_TASKS_PER_NODE"], env["SLURM_TASKS_PER_NODE"]
    with pytest.raises(ConfigError, match=r"SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE"):
        detect(env)


def test_missing_nodelist_needs_master_addr() -> None:
    env = {k: v for k, v in srun_env(0).items() if "NODELIST" not in k}
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NODELIST .* neither is MASTER_ADDR"):
        detect(env)
    assert detect(env | {"MASTER_ADDR": "n1"}).master_addr == "n1"


@pytest.mark.parametrize("port", ["0", "65536", "http"])
def test_bad_master_port(port: str) -> None:
    with pytest.raises(ConfigError, match=rf"MASTER_PORT='{port}'"):
        detect(srun_env(0) | {"MASTER_PORT": port})


# ---- contradictions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        (
            {"SLURM_STEP_TASKS_PER_NODE": "2,1"},
            ["SLURM_STEP_TASKS_PER_NODE='2,1'", "3 tasks", "SLURM_STEP_NUM_TASKS=4"],
        ),
        (
            {"SLURM_STEP_TASKS_PER_NODE": "1(x4)"},
            ["SLURM_STEP_TASKS_PER_NODE='1(x4)'", "4 nodes", "SLURM_STEP_NUM_NODES=2"],
        ),
        (
            {"SLURM_STEP_NODELIST": "n[1-3]"},
            ["SLURM_STEP_NODELIST='n[1-3]'", "3 hosts", "SLURM_STEP_NUM_NODES=2"],
        ),
        ({"SLURM_PROCID": "4"}, ["SLURM_PROCID=4", "SLURM_STEP_NUM_TASKS=4"]),
        ({"SLURM_PROCID": "-1"}, ["SLURM_PROCID=-1", "SLURM_STEP_NUM_TASKS=4"]),
        ({"SLURM_LOCALID": "2"}, ["SLURM_LOCALID=2", "SLURM_STEP_TASKS_PER_NODE[0]=2"]),
        ({"SLURM_NODEID": "2"}, ["SLURM_NODEID=2", "SLURM_STEP_NUM_NODES=2"]),
        ({"SLURM_STEP_NUM_TASKS": "0"}, ["SLURM_STEP_NUM_TASKS=0", "at least 1"]),
        ({"WORLD_SIZE": "8"}, ["WORLD_SIZE='8'", "SLURM_STEP_NUM_TASKS=4", "unset WORLD_SIZE"]),
        ({"RANK": "3"}, ["RANK='3'", "SLURM_PROCID=0", "unset RANK"]),
    ],
)
def test_contradictions_are_topology_errors(changes: dict[str, str], names: list[str]) -> None:
    with pytest.raises(TopologyError) as caught:
        detect(srun_env(0) | changes)
    for name in names:
        assert name in str(caught.value)
    assert caught.value.hint


def test_stray_variables_that_agree_are_accepted() -> None:
    env = srun_env(3) | {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "n1"}
    assert detect(env).rank == 3
