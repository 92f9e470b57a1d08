"""One rank ends with ``sys.exit(3)`` after the last collective, the other normally: a job
whose exit code tells a driver script something (an evaluation below its threshold). Rank 1
writes its report first (a second of solo work), so that rank 0 has left by then under either
launcher: torch's agent stops the ranks still running when one fails, and which of them are
still running would otherwise be a race.

Source: the ``sys.exit(main())`` shape of launcher-driven scripts, e.g. pytorch/examples,
distributed/ddp-tutorial-series and the torchrun documentation's note that the agent reports
a worker's non-zero exit code; here rank 1 returns 3 after everyone's last all_reduce.
Its exercise() runs last in lib_timm.py's script (tests/test_corpus.py).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def exercise(rank: int, world_size: int) -> int:
    """The rank's exit code: 3 on rank 1, which leaves the group to its exit."""
    score = torch.tensor([0.25 * (rank + 1)])
    dist.all_reduce(score)
    print(f"score {score.item()}")
    if rank == 1:
        time.sleep(1.0)  # writing its evaluation report
        print("rank 1: below the threshold, exit code 3")
        return 3
    return 0
