"""A requeued job comes back on fewer nodes (``nodes: 1-2``), on the real test cluster: the bad
node is excluded, the second attempt forms a smaller group and resumes from the checkpoint, and
every sample of the interrupted epoch is seen exactly once over both attempts.

One job per launch mode, each confined to two nodes by its own excludes (``launch: srun`` on
n1, n2; ``launch: torchrun`` on n3, n4: they run side by side), one process per node (few
processes to start: the test machine is small), a health check that fails on a node named in
the job folder's ``bad`` file. Attempt 0 (attempts count from 0, as ``ctx.attempt`` and the
log do) runs on both nodes (world 2), saves a checkpoint at step 4 (one step into epoch 1),
and at step 5 the rank on its last node names its node in ``bad`` and exits 1. The check
after the failed step blames that node, and the exclusion, which counts MIN (1) and not the 2
nodes the job has, requeues it without that node: one usable node is left. Attempt 1 starts
on one node (world 1: the job script's world size follows SLURM_JOB_NUM_NODES), resumes at
step 4, and finishes epoch 1 and the run. sacct: REQUEUED on 2 nodes, then COMPLETED on 1.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cluster.nodelist import expand_nodelist
from tests.jobs.test_health_check_cluster import MARKED_BAD, accounted
from tests.support.slurm_cluster import FINISHED, SlurmCluster

pytestmark = pytest.mark.slurm

SIZE, EPOCHS, SAVE_AT = 11, 2, 4  # batches of 2: at world 2, 3 steps an epoch; at world 1, 6
APP = f"""import json, os, sys
from pathlib import Path
import torch
import ddpkit
from ddpkit.cluster.nodelist import expand_nodelist

class Indices(torch.utils.data.Dataset):
    def __len__(self):
        return {SIZE}
    def __getitem__(self, index):
        return index

attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
node = os.environ["SLURMD_NODENAME"]
last = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])[-1]
ctx = ddpkit.init(backend="gloo")
torch.manual_seed(0)
model = ddpkit.wrap(torch.nn.Linear(1, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = ddpkit.loader(Indices(), 2, seed=3)
state = {{"model": model, "optimizer": optimizer, "loader": loader, "step": 0}}
folder = Path("run")
if ddpkit.load_checkpoint(folder, state) is not None and ctx.rank == 0:
    print(f"resumed at world size {{ctx.world_size}} at step {{state['step']}}", flush=True)
folder.mkdir(exist_ok=True)
log = folder / f"log-{{attempt}}-{{ctx.world_size}}-{{ctx.rank}}.jsonl"
while loader.state_dict()["epoch"] < {EPOCHS}:
    for batch in loader:
        loss = model(batch.float().unsqueeze(1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        kept = ddpkit.gather(batch).tolist()
        state["step"] += 1
        line = {{"epoch": loader.epoch, "step": state["step"], "kept": kept, "node": node}}
        with log.open("a") as out:
            out.write(json.dumps(line) + "\\n")
        if attempt == 0 and state["step"] == {SAVE_AT}:
            ddpkit.save_checkpoint(folder, state, step=state["step"])
        if attempt == 0 and state["step"] == {SAVE_AT + 1} and node == last and ctx.local_rank == 0:
            Path("bad.tmp").write_text(node)
            os.replace("bad.tmp", "bad")
            sys.exit(f"rank {{ctx.rank}} on {{node}}: this node just went bad")
print("app ran on", node, "world size", ctx.world_size, flush=True)
ddpkit.shutdown()
"""
# each job's two nodes, and the excludes that confine it to them
PAIRS = {"srun": (["n1", "n2"], "n3,n4"), "torchrun": (["n3", "n4"], "n1,n2")}


def submit(slurm: SlurmCluster, workdir: Path, launch: str) -> str:
    (workdir / "app.py").write_text(APP)
    (workdir / "check.sh").write_text(MARKED_BAD)
    spec = workdir / "job.yaml"
    spec.write_text(
        f"name: {workdir.name}\npartition: debug\nnodes: 1-2\nprocs_per_node: 1\n"
        f"launch: {launch}\ntime_min: 3\nworkdir: {workdir}\nlog_dir: logs\n"
        f"python: {sys.executable}\ncommand: app.py\nsbatch: {{exclude: '{PAIRS[launch][1]}'}}\n"
        f"health_check: bash {workdir / 'check.sh'}\nhealth_check_timeout_s: 20\n"
        "env: {OMP_NUM_THREADS: '1'}\n"
    )
    return slurm.submit_spec(spec, home=workdir / "home")


def lines(folder: Path, attempt: int, world: int) -> list[list[dict[str, Any]]]:
    """Every rank's step lines of ``attempt`` at ``world``, by rank, in step order."""
    by_rank = []
    for rank in range(world):
        path = folder / f"log-{attempt}-{world}-{rank}.jsonl"
        assert path.is_file(), f"{path} missing: {sorted(p.name for p in folder.iterdir())}"
        found = [json.loads(text) for text in path.read_text().splitlines()]
        by_rank.append(sorted(found, key=lambda s: s["step"]))
    return by_rank


@pytest.fixture(scope="module")
def jobs(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[str, Path, str, list[tuple[str, str, str]]]]:
    """Both jobs, submitted together: launch -> (job id, folder, final state, sacct's runs)."""
    slurm = slurm_cluster
    if not slurm.accounting:
        pytest.fail("these tests read the job's runs from sacct: start ci/slurm-up with accounting")
    done: dict[str, tuple[str, Path, str, list[tuple[str, str, str]]]] = {}
    try:
        # A job of another test holding a CPU of the pair makes SLURM start `nodes: 1-2` on the
        # one free node (seen in CI): that run tests nothing here, so it is run again, twice
        # at most; the test then names the placement if it still did not get both nodes.
        for _ in range(3):
            todo = [launch for launch in PAIRS if not _got_pair(launch, done.get(launch))]
            if not todo:
                break
            folders = {launch: tmp_path_factory.mktemp(f"nodes-{launch}") for launch in todo}
            ids = {launch: submit(slurm, folder, launch) for launch, folder in folders.items()}
            for launch, job in ids.items():
                state = slurm.wait(job, timeout_s=150, states=FINISHED)
                done[launch] = (job, folders[launch], state, accounted(slurm, job))
        return done
    finally:
        slurm.cancel_tracked()


def _got_pair(launch: str, found: tuple[str, Path, str, list[tuple[str, str, str]]] | None) -> bool:
    """Whether the job's first run had both nodes of its pair."""
    if found is None or not found[3]:
        return False
    return expand_nodelist(found[3][0][2]) == PAIRS[launch][0]


@pytest.mark.parametrize("launch", list(PAIRS))
def test_a_requeue_after_a_bad_node_resumes_on_one_node_seeing_every_sample_once(
    jobs: dict[str, tuple[str, Path, str, list[tuple[str, str, str]]]], launch: str
) -> None:
    job, folder, state, runs = jobs[launch]
    log = (folder / "logs" / f"{folder.name}-{job}.out").read_text(errors="replace")
    tasks = "".join(p.read_text(errors="replace") for p in sorted((folder / "logs").glob("*-*-*")))
    where = f"job {job}: {runs}\n{log}\n{tasks}"
    pair, _ = PAIRS[launch]
    assert state == "COMPLETED", where
    assert [run[0] for run in runs] == ["REQUEUED", "COMPLETED"], where
    first, second = (expand_nodelist(run[2]) for run in runs)
    assert first == pair, f"attempt 0 did not get both of {pair} (busy cluster?): {where}"
    bad = (folder / "bad").read_text().strip()
    assert bad == pair[-1] and second == [pair[0]], where
    assert (
        f"ddpkit: excluding node {bad} (health check failed after the job's step exited"
    ) in log, where
    assert f"ddpkit: health check passed on {pair[0]} (attempt 1)" in log, where
    assert f"resumed at world size 1 at step {SAVE_AT}" in tasks, where
    assert f"app ran on {pair[0]} world size 1" in tasks, where

    run = folder / "run"
    before, after = lines(run, 0, 2), lines(run, 1, 1)
    saved = [[s for s in rank_lines if s["step"] <= SAVE_AT] for rank_lines in before]
    for rank_lines in (*saved, *after):  # every rank of an attempt took the same steps
        peers = saved if rank_lines in saved else after
        assert [s["kept"] for s in rank_lines] == [s["kept"] for s in peers[0]], where
    assert [s["step"] for s in saved[0]] == list(range(1, SAVE_AT + 1)), where
    # attempt 0 went one step past its checkpoint (lost with it); attempt 1 redid it at world 1
    lost = [s for rank_lines in before for s in rank_lines if s["step"] > SAVE_AT]
    assert {s["step"] for s in lost} == {SAVE_AT + 1} and bad in {s["node"] for s in lost}, where
    assert after[0][0]["step"] == SAVE_AT + 1, where
    assert {s["node"] for r in after for s in r} == {pair[0]}, where
    kept = saved[0] + after[0]
    assert [s["step"] for s in kept] == list(range(1, len(kept) + 1)), where
    for epoch in range(EPOCHS):
        seen = Counter(i for s in kept if s["epoch"] == epoch for i in s["kept"])
        assert sorted(seen.elements()) == list(range(SIZE)), (epoch, seen)
    interrupted = [s["step"] for s in kept if s["epoch"] == 1]
    assert interrupted[0] == SAVE_AT and len(interrupted) == 1 + 4, where  # 1 at 2, 4 at 1
