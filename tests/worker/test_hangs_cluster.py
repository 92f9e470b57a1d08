"""On the real test cluster, 2 nodes x 1 process (``launch: torchrun``: one ``ddpkit run`` per
node; what the cluster adds is the report gathered across nodes, and more ranks a node would
only import torch more often): a stuck rank on the second node is named in one report within the
bound, set by the spec's ``hang_timeout_s``, a launcher quotes it and the job's log folder keeps
it; a rank-0-only barrier is named in that report with the ``if`` it runs under. Nothing of the
job is left running. Two jobs: the ways a rank can be stuck are variations that
tests/worker/test_hangs.py runs on real local ranks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.slurm_cluster import FINISHED, SlurmCluster
from tests.worker.test_hangs import WORKER

pytestmark = pytest.mark.slurm

PIDS = re.compile(r"pid (\d) (\d+)$", re.MULTILINE)


def _submit(slurm: SlurmCluster, tmp_path: Path, case: str, stuck: int) -> tuple[str, str]:
    """Run the job to its end; (its final state, every log of it)."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: hang-{case}\npartition: debug\nnodes: 2\nprocs_per_node: 1\n"
        f"workdir: {tmp_path}\nlog_dir: logs\nlaunch: torchrun\ntime_min: 5\n"
        "hang_timeout_s: 5\nhang_first_timeout_s: 120\n"
        "env: {DDPKIT_PEER_TIMEOUT: '5', DDPKIT_HANG_ACTION: end}\n"
        f"command: {worker} --case {case} --stuck {stuck}\n"
    )
    job = slurm.submit_spec(spec, home=tmp_path / "home")
    state = slurm.wait(job, timeout_s=150, states=FINISHED)
    logs = "\n".join(
        path.read_text(errors="replace") for path in sorted((tmp_path / "logs").glob("*"))
    )
    assert slurm.processes(str(worker)) == [], "left running"
    return state, logs


def test_a_stuck_rank_on_the_second_node_is_named_in_the_report_and_the_summary(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Rank 1, on the second node, waits for its data loader worker: the report gathered
    across nodes names it with its place and its worker's pid. The other ways of being stuck
    (a sleep, another collective) are gathered the same way and named by the real ranks of
    tests/worker/test_hangs.py: a job of its own each would start 2 launchers and 2 ranks
    more to show nothing the cluster adds."""
    stuck = 1
    named = (
        r"is in \S*worker.py:\d+ `for batch in batches:`, not in a collective, waiting for "
        r"its data loader worker\(s\) \(pids \d+\)"
    )
    state, logs = _submit(slurm, tmp_path, "loader", stuck)
    assert state == "FAILED", logs[-4000:]
    pids = {int(rank): pid for rank, pid in PIDS.findall(logs)}
    assert sorted(pids) == [0, 1], logs[-4000:]
    head = rf"ddpkit: hang: rank {stuck} \(host (\S+), pid {pids[stuck]}\) {named}"
    found = re.search(head, logs)
    assert found, logs[-6000:]
    assert "bound: DDPKIT_HANG_TIMEOUT=5)" in logs
    # a node's `ddpkit run` quotes the report from its own attempt folder (the other node's
    # may be ended by srun's --kill-on-bad-exit before it writes its summary)
    assert "ddpkit: the job hung; the hang watchdog's report (from " in logs, logs[-6000:]
    (kept,) = (tmp_path / "logs").glob("ddpkit-hang-report-*.txt")  # the job's log folder
    assert re.match(head, kept.read_text()), kept.read_text()


def test_a_rank_zero_only_barrier_is_named_in_the_report(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    state, logs = _submit(slurm, tmp_path, "rank0", 0)
    assert state == "FAILED", logs[-4000:]
    assert "UsageError" not in logs
    found = re.search(
        r"ddpkit: hang: rank 0 \(host \S+, pid \d+\) is in barrier #\d+ on default_pg at "
        r"\S*worker.py:\d+ \(for [\d.]+ s\), called under "
        r"`if opts.case == 'rank0' and ctx.is_main:` \(\S*worker.py:\d+\), rank-0-only code "
        r"that rank 1 skips; rank 1 waits in all_reduce #",
        logs,
    )
    assert found, logs[-6000:]
