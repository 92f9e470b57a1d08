"""torch's env:// variables in a SLURM batch script (no srun step), on the real cluster.

mp.spawn in the batch script forms one group (marker ``slurm``); the rest of env:// detection
is tests/cluster/test_env_torchenv.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slurm


# --- mp.spawn in a SLURM batch script (no srun step), on the real cluster -----------------

_SPAWN = """
import json, os, socket, sys
import torch.multiprocessing as mp

def worker(rank, out, port):
    # the recipe: export torch's env:// variables, then init
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch, torch.distributed as dist
    import ddpkit
    ctx = ddpkit.init(connect_timeout_s=60)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump({"rank": ctx.rank, "world": ctx.world_size, "launcher": ctx.info.launcher,
                   "sum": total.item(), "job": os.environ["SLURM_JOB_ID"]}, handle)
    ddpkit.shutdown()

if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(worker, args=(sys.argv[1], port), nprocs=2)
"""


def test_mp_spawn_in_a_batch_script_forms_one_group(slurm: Any, tmp_path: Path) -> None:
    # The batch script's SLURM variables (SLURM_PROCID=0, SLURM_NTASKS=1, no step) made each
    # spawned process a single world of one, silently (no note: SLURM_NTASKS is 1).
    spawn = tmp_path / "spawn.py"
    spawn.write_text(_SPAWN)
    out = tmp_path / "job.out"
    script = (
        "#!/bin/bash\n"
        f"#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=2 --output={out} --time=5\n"
        f"{sys.executable} -u {spawn} {tmp_path}\n"
    )
    job = slurm.sbatch(script, cwd=tmp_path)
    state = slurm.wait(job, timeout_s=180)
    text = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", text
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(s["rank"], s["world"], s["launcher"]) for s in seen] == [(0, 2, "env"), (1, 2, "env")]
    assert {(s["sum"], s["job"]) for s in seen} == {(3.0, job)}, text
