"""A run stopped mid-epoch at world 2, resumed at world 3, stopped mid-epoch again and resumed
at world 2 to its end, each piece a real ``ddpkit run`` launch (gloo on 127.0.0.1) that saves
and loads real checkpoints (tests/scripts/resize_worker.py): every sample of every epoch is
kept exactly once by ``gather`` over the pieces, and the epochs before and after the resize are
the uninterrupted run's, rank by rank and step by step: torch's ``DistributedSampler`` order at
world 2 with the worker's seed, which an uninterrupted ``ddpkit.loader`` run follows (computed
here: a fourth launch, of 2 ranks, would cost a fifth of the test's CPU). Worlds 2 and 3, not
4 and 2: the run still shrinks and grows mid-epoch, with padding at both sizes, from 7 fresh
worker interpreters instead of 10 (each imports torch anew; the worker builds no model nor
optimizer, whose DDP and ``torch.optim`` would import ``torch._dynamo`` in each too)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DistributedSampler

from ddpkit.cli import main

pytestmark = pytest.mark.sidecar  # mostly waiting: run beside the SLURM tests (ci/test.sh)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/scripts/resize_worker.py"
SIZE, EPOCHS = 23, 3  # at world 2: 12 a rank (one padding position), 6 steps of 2 an epoch
HOME, OTHER = 2, 3  # the run's world size, and the one of its middle piece
BATCH, SEED = 2, 3  # the worker's


def launch(folder: Path, nproc: int, stop: int) -> None:
    argv = ["run", "--nnodes", "1", "--nproc-per-node", str(nproc), str(SCRIPT)]
    assert main([*argv, str(folder), str(EPOCHS), str(stop)]) == 0


def steps(folder: Path, world: int) -> list[list[dict[str, Any]]]:
    """Every rank's log lines at ``world``, by rank, in step order."""
    by_rank = []
    for rank in range(world):
        lines = (folder / f"log-{world}-{rank}.jsonl").read_text().splitlines()
        by_rank.append(sorted((json.loads(line) for line in lines), key=lambda s: s["step"]))
    return by_rank


@pytest.mark.multiproc
def test_resume_at_another_world_size_keeps_every_sample_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("DDPKIT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    run = tmp_path / "run"
    launch(run, HOME, 7)  # epoch 0 (6 steps) and the first step of epoch 1 (4 of 23 samples)
    launch(run, OTHER, 2)  # 2 of the 4 steps the other 19 make at world 3 (7 a rank, 1 padding)
    launch(run, HOME, 0)  # the last 7 samples of epoch 1 at world 2 (2 steps), then epoch 2
    home, other = steps(run, HOME), steps(run, OTHER)
    for rank_lines in [*home, *other]:  # every rank logged the same steps as its world's rank 0
        peers = home if rank_lines in home else other
        assert [s["step"] for s in rank_lines] == [s["step"] for s in peers[0]]
        assert [s["kept"] for s in rank_lines] == [s["kept"] for s in peers[0]]
    pieces = sorted(home[0] + other[0], key=lambda s: s["step"])
    assert [s["step"] for s in pieces] == list(range(1, len(pieces) + 1))  # no step twice
    worlds = [(s["epoch"], OTHER if s in other[0] else HOME) for s in pieces]
    assert worlds == [(0, 2)] * 6 + [(1, 2), (1, 3), (1, 3), (1, 2), (1, 2)] + [(2, 2)] * 6
    for epoch in range(EPOCHS):
        kept = Counter(i for s in pieces if s["epoch"] == epoch for i in s["kept"])
        assert sorted(kept.elements()) == list(range(SIZE)), epoch  # each sample exactly once
    for rank in range(HOME):  # before and after the resize, the uninterrupted run's order
        resumed = [s["ids"] for s in home[rank] if s["epoch"] != 1]
        assert resumed == uninterrupted(rank, 0) + uninterrupted(rank, 2), rank


def uninterrupted(rank: int, epoch: int) -> list[list[int]]:
    """``rank``'s batches of ``epoch`` at world 2 in a run never stopped (sample ``i`` is
    ``i``): torch's own sharded shuffle, in batches of 2."""
    sampler = DistributedSampler(range(SIZE), num_replicas=HOME, rank=rank, shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    ids = list(sampler)
    return [ids[start : start + BATCH] for start in range(0, len(ids), BATCH)]
