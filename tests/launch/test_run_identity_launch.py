"""``ddpkit run --max-restarts 1`` whose first attempt fails on purpose: both attempts of every
rank share one run id (the one the launcher fixed for this launch), the second is attempt 1 and
finds the checkpoint attempt 0 wrote, under the same run id (that a second launch is another
run: tests/cluster/test_runid.py and the standalone test of tests/launch/test_run.py). The
workers read their identity as ``ddpkit.init`` does, from the launcher's variables (that
``init`` gives every rank of a gloo group that identity: tests/worker/test_run_identity.py);
rank 0 saves and reads real checkpoints (tests/scripts/run_id_worker.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddpkit.cli import main

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^\[rank(\d)\]: run (\S+) attempt (\d+)$", re.MULTILINE)
ORIGIN = re.compile(r"^\[rank0\]: origin (\S+)$", re.MULTILINE)  # one line an attempt


def launch(
    capfd: pytest.CaptureFixture[str], folder: Path
) -> tuple[list[tuple[str, ...]], list[str], str]:
    argv = ["run", "--nproc-per-node", "2", "--max-restarts", "1"]
    code = main([*argv, str(ROOT / "tests/scripts/run_id_worker.py"), str(folder)])
    captured = capfd.readouterr()
    output = f"stdout:\n{captured.out}\nstderr:\n{captured.err[-4000:]}"
    assert code == 0, output
    return LINE.findall(captured.out), ORIGIN.findall(captured.out), output


@pytest.mark.multiproc
def test_restarted_workers_keep_the_run_id_and_count_the_attempt(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("DDPKIT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    lines, origins, output = launch(capfd, tmp_path / "ckpt")
    assert sorted((rank, attempt) for rank, _, attempt in lines) == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1"),
    ], output  # fmt: skip
    (run_id,) = {run_id for _, run_id, _ in lines}
    # rank 0, attempt 0 then attempt 1 (which restarts only once attempt 0 has saved)
    assert origins == ["none", f"{run_id}/0"], output
