"""``nodes: MIN-MAX``: the spec's parsing and one-line errors, the sbatch script
(``--nodes=MIN-MAX`` without ``--ntasks-per-node``, the world size and torchrun's ``--nnodes`` from
``SLURM_JOB_NUM_NODES`` at run time, the exclusion told MIN), ``plan``, job records, and the
backends that cannot start a range refusing it. The real cluster: tests/jobs/test_nodes_cluster.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.cli import main
from ddpkit.errors import ConfigError
from ddpkit.jobs import render
from ddpkit.jobs.load import build_spec
from ddpkit.jobs.records import load_record, new_record, record_path, save_record
from ddpkit.jobs.spec import JobSpec
from tests.fakes.slurm import FakeTools

BASE = {"name": "ranged", "command": "train.py", "workdir": "/w", "python": "/py"}


def spec(nodes: object, **fields: object) -> JobSpec:
    return build_spec({**BASE, "nodes": nodes, **fields}).spec


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [("1-2", (2, 1, "1-2")), ("2-8", (8, 2, "2-8")), ("3-3", (3, None, "3")), (4, (4, None, "4"))],
)
def test_a_range_is_max_nodes_with_its_min(nodes: object, expected: tuple[object, ...]) -> None:
    job = spec(nodes, procs_per_node=2)
    assert (job.nodes, job.min_nodes, job.node_range) == expected
    assert job.world_size == 2 * job.nodes
    assert job.min_world_size == 2 * (job.min_nodes or job.nodes)


def test_set_takes_a_range_over_the_specs_count() -> None:
    assert build_spec({**BASE, "nodes": 4}, ["nodes=1-2"]).spec.node_range == "1-2"
    assert build_spec({**BASE, "nodes": "1-2"}, ["nodes=3"]).spec.node_range == "3"


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ("3-2", "nodes='3-2': has MIN 3 above MAX 2 (hint: MIN <= MAX, e.g. nodes: 2-3)"),
        ("0-2", "nodes='0-2': starts at 0: a job needs a node (hint: MIN >= 1, e.g. nodes: 1-2)"),
        ("1-2x", "nodes='1-2x': is not a whole number or a range MIN-MAX (hint: e.g. nodes: 2,"),
        ("1 - 2", "nodes='1 - 2': is not a whole number or a range MIN-MAX"),
        ("-1-2", "nodes='-1-2': is not a whole number or a range MIN-MAX"),
        ("1-2-3", "nodes='1-2-3': is not a whole number or a range MIN-MAX"),
        ("a-b", "nodes='a-b': is not a whole number or a range MIN-MAX"),
        ("1-", "nodes='1-': is not a whole number or a range MIN-MAX"),
        ("2", "nodes='2': is not a whole number or a range MIN-MAX (hint: write it unquoted"),
        ("1-100001", "nodes='1-100001': has MAX 100001, more than 100000, ddpkit's limit"),
        (1.5, "nodes=1.5: is not a whole number (hint: a whole number >= 1, or a range MIN-MAX"),
    ],
)
def test_a_bad_range_is_one_line_naming_the_field_value_and_a_hint(
    nodes: object, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        spec(nodes)
    text = str(caught.value)
    assert message in text and "\n" not in text, text


def test_min_nodes_is_not_a_key_of_its_own() -> None:
    with pytest.raises(ConfigError, match=r"min_nodes=1: is not a key of its own \(hint: write"):
        build_spec({**BASE, "nodes": 2, "min_nodes": 1})


def test_the_cli_refuses_a_bad_range_with_exit_2_and_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: r\ncommand: train.py\nnodes: 1-2\n")
    assert main(["plan", str(path), "--set", "nodes=2-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--set: nodes='2-1': has MIN 2 above MAX 1" in err, err
    assert main(["submit", "--dry-run", str(path)]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=1-2\n" in out and "--ntasks-per-node" not in out.split("\nset ")[0]


# ---------------------------------------------------------------------------- the script


def test_sbatch_gets_the_range_and_no_tasks_per_node() -> None:
    fixed = dict(render.sbatch_options(spec(2, procs_per_node=3, cpus_per_task=2)))
    assert (fixed["nodes"], fixed["ntasks-per-node"], fixed["cpus-per-task"]) == ("2", "3", "2")
    for launch in ("srun", "torchrun"):
        ranged = dict(render.sbatch_options(spec("1-2", procs_per_node=3, cpus_per_task=2,
                                                 launch=launch)))  # fmt: skip
        # with --ntasks-per-node, sbatch counts MIN x it tasks and SLURM starts MIN nodes
        assert "ntasks-per-node" not in ranged
        assert (ranged["nodes"], ranged["cpus-per-task"]) == ("1-2", "6")  # a node's CPUs


def run_script(job: JobSpec, tmp_path: Path, num_nodes: int) -> tuple[list[str], dict[str, str]]:
    """Run the rendered script under bash as SLURM would start it on ``num_nodes`` nodes (stub
    srun); the srun's argv and environment."""
    stubs, records = tmp_path / "stubs", tmp_path / f"records-{num_nodes}"
    FakeTools(stubs).recorders("srun", "scontrol")
    records.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(render.render_sbatch(job))
    nodelist = "n3" if num_nodes == 1 else f"n[3-{2 + num_nodes}]"
    env = {
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "RECORD_DIR": str(records),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(num_nodes),
    }
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    (call,) = [p for p in records.iterdir() if p.name.startswith("srun")]
    argv = (call / "argv").read_bytes().decode().split("\0")[:-1]
    seen = dict(i.split("=", 1) for i in (call / "env").read_bytes().decode().split("\0")[:-1])
    return argv, seen


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_the_world_size_follows_the_nodes_the_attempt_got(tmp_path: Path, launch: str) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    job = spec("1-3", procs_per_node=2, launch=launch, workdir=str(workdir),
               python=sys.executable, rdzv_port=29400)  # fmt: skip
    for num_nodes in (1, 2, 3):
        argv, env = run_script(job, tmp_path, num_nodes)
        assert env["DDPKIT_EXPECTED_WORLD_SIZE"] == str(2 * num_nodes)
        if launch == "srun":  # the step lays out procs_per_node tasks on every node it has
            assert "--ntasks-per-node=2" in argv and "--cpus-per-task=1" in argv, argv
        else:  # one agent per node; the rendezvous waits for exactly this attempt's nodes
            assert "--ntasks-per-node=1" in argv and "--cpus-per-task=2" in argv, argv
            at = argv.index("--nnodes")
            assert argv[at : at + 4] == ["--nnodes", str(num_nodes), "--nproc-per-node", "2"]


def test_a_fixed_count_keeps_its_literal_world_size_and_nnodes() -> None:
    text = render.render_sbatch(spec(2, procs_per_node=2, launch="torchrun"))
    assert "export DDPKIT_EXPECTED_WORLD_SIZE=4\n" in text
    assert "--nnodes 2 " in text and "SLURM_JOB_NUM_NODES" not in text


def test_the_health_check_runs_on_the_nodes_it_has_and_tells_the_exclusion_min() -> None:
    fixed = render.render_sbatch(spec(2, health_check="true"))
    assert "srun --nodes=2 --ntasks=2 " in fixed and "--min-nodes" not in fixed
    ranged = render.render_sbatch(spec("1-2", health_check="true"))
    assert 'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" ' in ranged
    assert ranged.count("-m ddpkit.cluster.stop.exclude --max-excluded 2 --min-nodes 1 ") == 2


def test_the_latch_waits_for_every_process_of_the_attempt() -> None:
    srun = render.template_context(spec("1-2", procs_per_node=2))["latch_markers"]
    torchrun = render.template_context(spec("1-2", procs_per_node=2, launch="torchrun"))
    assert srun == '"$((SLURM_JOB_NUM_NODES * 2))"'
    assert torchrun["latch_markers"] == '"$((SLURM_JOB_NUM_NODES * 3))"'  # and each agent
    assert render.template_context(spec(2, procs_per_node=2))["latch_markers"] == 4


# ---------------------------------------------------------------------------- records


def test_a_record_keeps_the_range_and_an_old_record_still_loads(tmp_path: Path) -> None:
    saved = new_record(spec("1-2"), "77", "sbatch", "#!/bin/bash\n")
    assert (saved.nodes, saved.min_nodes) == (2, 1)
    save_record(saved, home=tmp_path)
    assert load_record("77", home=tmp_path) == saved
    path = record_path("77", home=tmp_path)
    data = json.loads(path.read_text())
    del data["min_nodes"]  # as written before ranges existed
    path.write_text(json.dumps(data))
    old = load_record("77", home=tmp_path)
    assert old is not None and (old.nodes, old.min_nodes) == (2, None)
    path.write_text(json.dumps({**data, "min_nodes": 0}))
    with pytest.raises(ConfigError, match="has min_nodes=0, which ddpkit never writes"):
        load_record("77", home=tmp_path)


# ---------------------------------------------------------------------------- other backends


def test_submitit_refuses_a_range_naming_itself() -> None:
    from ddpkit.jobs.backends.submitit import executor_parameters

    assert executor_parameters(spec(2))["nodes"] == 2
    with pytest.raises(ConfigError) as caught:
        executor_parameters(spec("1-2"))
    text = str(caught.value)
    assert text.startswith("nodes='1-2' (a range) cannot go through submitit") and "\n" not in text
    assert "hint: submit it with --via sbatch, or set nodes: 2" in text


def test_torchx_refuses_a_range_naming_itself() -> None:
    from ddpkit.jobs.backends.torchx_appdef import refuse_sweep

    refuse_sweep(spec(2))
    with pytest.raises(ConfigError) as caught:
        refuse_sweep(spec("1-2"))
    text = str(caught.value)
    assert text.startswith("nodes='1-2' (a range) cannot go through torchx") and "\n" not in text


@pytest.mark.parametrize("via", ["submitit", "torchx"])
def test_the_cli_refuses_a_range_for_another_backend_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], via: str
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"name: r\ncommand: train.py\nnodes: 1-2\nworkdir: {tmp_path}\n")
    assert main(["submit", "--dry-run", "--via", via, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"nodes='1-2' (a range) cannot go through {via}" in err, err
