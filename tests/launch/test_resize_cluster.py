"""On the real test cluster: one run (one ``DDPKIT_RUN_ID``, one checkpoint folder) as three jobs,
2 nodes x 1, then 1 node x 1, then 2 x 1 again, the first two stopped mid-epoch after saving
(tests/scripts/resize_worker.py, ``launch: srun``): every sample of every epoch is kept once
by ``gather`` over the jobs, and the epoch after the resize is in the order of an
uninterrupted run (the local test, tests/launch/test_resize_launch.py, compares with a real
one; here the order comes from torch's sampler layout, :mod:`ddpkit.worker.reshard`).
One process a node: the world still shrinks (2 to 1) and grows (1 to 2) with the job's nodes,
mid-epoch, from 5 worker interpreters instead of the 10 of 2 a node (each imports torch).

Here each size is a new submission; a requeued job that comes back on fewer nodes
(``nodes: MIN-MAX``) is tests/jobs/test_nodes_cluster.py's."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from ddpkit.worker import reshard
from tests.launch.test_resize_launch import EPOCHS, SIZE, steps
from tests.scripts.resize_worker import BATCH, SEED
from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "resize_worker.py"


def run_piece(slurm: SlurmCluster, tmp_path: Path, nodes: int, stop: int) -> None:
    spec = tmp_path / f"piece-{nodes}-{stop}.yaml"
    spec.write_text(
        f"name: resize\npartition: debug\nnodes: {nodes}\nprocs_per_node: 1\n"
        f"workdir: {tmp_path}\nlog_dir: logs\nlaunch: srun\ntime_min: 5\n"
        f"env: {{DDPKIT_RUN_ID: resize-run}}\n"
        f"command: {SCRIPT} {tmp_path / 'run'} {EPOCHS} {stop}\n"
    )
    job = slurm.submit_spec(spec, home=tmp_path / "home")
    state = slurm.wait(job, timeout_s=240, states=FINISHED)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((tmp_path / "logs").glob("*")))
    assert state == "COMPLETED", logs


def test_a_run_resumed_on_fewer_nodes_then_more_keeps_every_sample_once(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # world 2: 12 a rank (one padding position), 6 steps an epoch; world 1: 12 steps an epoch
    run_piece(slurm, tmp_path, 2, 7)  # world 2: epoch 0 and the first step of epoch 1
    run_piece(slurm, tmp_path, 1, 4)  # world 1: 4 of the 10 steps the other 19 samples make
    run_piece(slurm, tmp_path, 2, 0)  # world 2: the last 11 of epoch 1 (3 steps), then epoch 2
    two, one = steps(tmp_path / "run", 2), steps(tmp_path / "run", 1)
    pieces = sorted(two[0] + one[0], key=lambda s: s["step"])
    assert [s["step"] for s in pieces] == list(range(1, 21))
    assert [s["epoch"] for s in pieces] == [0] * 6 + [1] * 8 + [2] * 6
    assert [s["step"] for s in one[0]] == [8, 9, 10, 11]
    assert [s["step"] for s in two[1]] == [s["step"] for s in two[0]]
    for epoch in range(EPOCHS):
        kept = Counter(i for s in pieces if s["epoch"] == epoch for i in s["kept"])
        assert sorted(kept.elements()) == list(range(SIZE)), epoch
    order = reshard.epoch_order(SIZE, shuffle=True, seed=SEED, epoch=2)
    for rank in range(2):
        mine = reshard.shard(order, 0, 2, rank, False)
        expected = [mine[i : i + BATCH] for i in range(0, len(mine), BATCH)]
        assert [s["ids"] for s in two[rank] if s["epoch"] == 2] == expected, rank
