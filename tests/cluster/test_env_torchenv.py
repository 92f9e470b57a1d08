"""torch's env:// variables alone (RANK, WORLD_SIZE, MASTER_*): a job, or a one-line error.

Before, any set of them without torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE was detected as a
single process: every process of the job trained alone as rank 0 of 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from typing import Any

import pytest

import ddpkit
from ddpkit.cluster.detect import detect
from ddpkit.cluster.environments.torchenv import TorchEnvEnvironment
from ddpkit.errors import ConfigError, TopologyError, UsageError
from tests.cluster.test_env_slurm import BATCH_ENV
from tests.support.distutil import free_port, run_workers
from tests.worker.rendezvous.test_store import clean_env

MASTER = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}

# (variables, (rank, local_rank, world, local_world, node_rank, num_nodes))
_JOBS = [
    # Kubeflow PyTorchJob v1, one process per pod: each pod is a host of its own.
    ({"RANK": "3", "WORLD_SIZE": "4", **MASTER}, (3, 0, 4, 1, 3, 4)),
    # mp.spawn / hand exports, LOCAL_WORLD_SIZE given: torchrun's block placement.
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", **MASTER}, (5, 1, 8, 4, 1, 2)),
    ({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", **MASTER}, (2, 2, 3, 3, 0, 1)),
    # A world of one needs no master.
    ({"RANK": "0", "WORLD_SIZE": "1"}, (0, 0, 1, 1, 0, 1)),
    ({"WORLD_SIZE": "1"}, (0, 0, 1, 1, 0, 1)),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, (0, 0, 1, 1, 0, 1)),
    # A SLURM batch script's own processes (mp.spawn there): theirs, not SLURM's view.
    (BATCH_ENV | {"RANK": "1", "WORLD_SIZE": "2", **MASTER}, (1, 0, 2, 1, 1, 2)),
]


@pytest.mark.parametrize(("env", "expected"), _JOBS)
def test_env_method_variables_make_a_job(
    env: dict[str, str], expected: tuple[int, int, int, int, int, int]
) -> None:
    info = detect(env)
    assert info.launcher == "env"
    got = (
        info.rank,
        info.local_rank,
        info.world_size,
        info.local_world_size,
        info.node_rank,
        info.num_nodes,
    )
    assert got == expected
    if info.world_size > 1:
        assert (info.master_addr, info.master_port) == ("node0", 29500)
    assert info.notes == ()


# (variables, what the one line must say: the ones set, then the ones missing)
_INCOMPLETE = [
    (
        {"RANK": "1", "WORLD_SIZE": "2"},
        "RANK='1', WORLD_SIZE='2' set but not MASTER_ADDR, MASTER_PORT",
    ),
    (
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "n0"},
        "MASTER_ADDR='n0' set but not MASTER_PORT",
    ),
    (
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234"},
        "MASTER_PORT='1234' set but not MASTER_ADDR",
    ),
    (
        {"RANK": "1", **MASTER},
        "RANK='1', MASTER_ADDR='node0', MASTER_PORT='29500' set but not WORLD_SIZE",
    ),
    ({"RANK": "0"}, "RANK='0' set but not WORLD_SIZE"),  # not a world of one: WORLD_SIZE says it
    ({"WORLD_SIZE": "2", **MASTER}, "MASTER_PORT='29500' set but not RANK"),
    (
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", **MASTER},
        "LOCAL_RANK='1' set but not LOCAL_WORLD_SIZE",
    ),
    # torchrun's own half without RANK/WORLD_SIZE: a process told it is not alone on its host
    ({"LOCAL_RANK": "1"}, "LOCAL_RANK='1' set but not RANK, WORLD_SIZE"),
    ({"LOCAL_WORLD_SIZE": "2"}, "LOCAL_WORLD_SIZE='2' set but not RANK, WORLD_SIZE"),
    (
        {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", **MASTER},
        "MASTER_PORT='29500', LOCAL_RANK='0', LOCAL_WORLD_SIZE='2' set but not RANK, WORLD_SIZE",
    ),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' set but not RANK, WORLD_SIZE"),
]


@pytest.mark.parametrize(("env", "message"), _INCOMPLETE)
def test_an_incomplete_set_is_a_one_line_error_naming_the_variables(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        detect(env)
    text = str(caught.value)
    assert message in text and "\n" not in text
    assert caught.value.hint and ("torchrun" in caught.value.hint or "LOCAL" in caught.value.hint)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2", **MASTER}, r"RANK=2 is outside \[0, WORLD_SIZE=2\)"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
        ({"RANK": "x", "WORLD_SIZE": "2", **MASTER}, "RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "²"}, "WORLD_SIZE='²' is not an integer"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": " ", "MASTER_PORT": "1"}, "MASTER_ADDR"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "0"}, "MASTER_PORT"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "8", **MASTER}, "LOCAL_WORLD_SIZE=8"),
        ({"RANK": "1", "WORLD_SIZE": "1"}, r"RANK=1 is outside \[0, WORLD_SIZE=1\)"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], match: str) -> None:
    with pytest.raises((ConfigError, TopologyError), match=match):
        detect(env)


def test_detected_by_the_variables_that_say_several_processes() -> None:
    assert TorchEnvEnvironment.detect({"RANK": "0"})
    assert TorchEnvEnvironment.detect({"WORLD_SIZE": "2"})
    assert TorchEnvEnvironment.detect({"LOCAL_RANK": "1"})
    assert TorchEnvEnvironment.detect({"LOCAL_WORLD_SIZE": "2"})
    # what a world of one may carry over from a shell: MASTER_*, a LOCAL_* of one process
    one = (
        {"LOCAL_RANK": "0"},
        {"LOCAL_WORLD_SIZE": "1"},
        {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
    )
    for env in ({}, MASTER, *one):
        assert not TorchEnvEnvironment.detect(env)
        assert detect(env).launcher == "single"


def test_torchruns_own_variables_win() -> None:
    # torchrun in a Kubeflow pod: the pod's RANK/WORLD_SIZE are replaced by torchrun's, and
    # its LOCAL_*/TORCHELASTIC_* variables say who started the worker.
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", **MASTER}
    assert detect(env | {"TORCHELASTIC_RUN_ID": "kf"}).launcher == "torchrun"
    assert detect(env).launcher == "torchrun"


# --- in init(): a real job of hand-exported variables --------------------------------------


def _hand_exported(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """A process given RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT by hand, nothing else."""
    import os

    import torch
    import torch.distributed as dist

    exported = {"RANK": str(rank), "WORLD_SIZE": str(world_size)}
    env = clean_env(**exported, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.clear()  # as a launcher would have started it
    os.environ.update(env)
    ctx = ddpkit.init(connect_timeout_s=60)
    total = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(total)
    ddpkit.shutdown()
    return {"rank": ctx.rank, "world": ctx.world_size, "launcher": ctx.info.launcher,
            "local_rank": ctx.local_rank, "sum": total.item()}  # fmt: skip


@pytest.mark.multiproc
def test_hand_exported_rank_and_world_size_form_one_group() -> None:
    # Two processes (forked from run_workers' server), each given RANK, WORLD_SIZE, MASTER_ADDR,
    # MASTER_PORT and nothing else (no LOCAL_*, no TORCHELASTIC_*): before, two worlds of one,
    # each "rank 0 of 1".
    seen = run_workers(_hand_exported, 2, timeout_s=120)
    assert [(s["rank"], s["world"], s["launcher"]) for s in seen] == [(0, 2, "env"), (1, 2, "env")]
    assert [s["local_rank"] for s in seen] == [0, 0]  # one process per host, by the rule
    assert [s["sum"] for s in seen] == [3.0, 3.0]


@pytest.mark.parametrize(
    ("variables", "line"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, "RANK='1', WORLD_SIZE='2' set but not"),
        ({"LOCAL_RANK": "1"}, "LOCAL_RANK='1' set but not RANK, WORLD_SIZE"),
    ],
)
def test_an_incomplete_set_fails_init_before_anything_waits(
    variables: dict[str, str], line: str
) -> None:
    # in this process: init() raises before it joins (nothing waits, nothing is left behind)
    with pytest.raises(ConfigError) as caught:
        ddpkit.init(env=clean_env(**variables))
    assert str(caught.value).startswith(line), caught.value
    assert "\n" not in str(caught.value)
    with pytest.raises(UsageError):  # no context was made
        ddpkit.current()


# --- init() inside someone else's group: adopted, whatever the environment says ----------


def _adopt_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # a partial env:// set, which detection alone rejects: the group's numbers win
        ctx = ddpkit.init(env={"RANK": str(rank)})
    seen = {
        "ctx": (ctx.rank, ctx.world_size, ctx.backend),
        "noted": any("adopting the existing process group" in str(w.message) for w in caught),
    }
    ddpkit.shutdown()
    seen["spared"] = dist.is_initialized()
    dist.barrier()
    dist.destroy_process_group()
    return seen


@pytest.mark.multiproc
def test_init_inside_a_foreign_group_adopts_it_even_with_a_partial_environment() -> None:
    for rank, seen in enumerate(run_workers(_adopt_worker, 2)):
        assert seen["ctx"] == (rank, 2, "gloo")
        assert seen["noted"] and seen["spared"]


# --- mp.spawn, the tutorial recipe: MASTER_* exported, rank and world size only as arguments --

# Both recipes in one parent (a spawned child imports torch: each interpreter saved counts):
# first MASTER_* alone, whose children must fail, then with RANK/WORLD_SIZE exported too.
_SPAWN = """
import json, os, sys
import torch.multiprocessing as mp
import ddpkit

def work(rank, world_size, port, export_rank):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if export_rank:
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    ctx = ddpkit.init(connect_timeout_s=60)
    # one write a line: both children share this pipe, and under PYTHONUNBUFFERED=1 print
    # writes its text and its newline apart ('{"rank": 1, ...}{"rank": 0, ...}' in a CI run)
    line = {"rank": ctx.rank, "world": ctx.world_size, "exported": export_rank}
    os.write(1, (json.dumps(line) + "\\n").encode())
    ddpkit.shutdown()

if __name__ == "__main__":
    try:
        mp.spawn(work, args=(2, int(sys.argv[1]), False), nprocs=2)
    except mp.ProcessRaisedException as exc:
        os.write(2, f"master-only: {exc}\\n".encode())
    else:
        os.write(2, b"master-only: no child failed\\n")
    mp.spawn(work, args=(2, int(sys.argv[2]), True), nprocs=2)
"""


@pytest.mark.multiproc
def test_mp_spawn_children_are_never_worlds_of_one(tmp_path: Any) -> None:
    script = tmp_path / "spawn.py"
    script.write_text(_SPAWN)
    done = subprocess.run(
        [sys.executable, str(script), str(free_port()), str(free_port())],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    seen = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    # MASTER_* alone: before, two processes, each "rank 0 of 1", each training alone
    assert not [s for s in seen if not s["exported"]], done.stdout + done.stderr
    master_only = done.stderr[done.stderr.find("master-only: ") :]
    assert (
        master_only.startswith("master-only: ")
        and "ConfigError: MASTER_ADDR='127.0.0.1', MASTER_PORT=" in master_only
        and "set in a process started by multiprocessing (mp.spawn?) but not RANK, WORLD_SIZE"
        in master_only
    ), done.stderr
    # what the hint says to do, RANK and WORLD_SIZE exported too: one world of two
    assert done.returncode == 0, done.stderr
    assert sorted((s["rank"], s["world"]) for s in seen) == [(0, 2), (1, 2)], done.stdout
