"""Torch-free payload: the rank this process was given, as ``ddpkit.init()`` would detect it.

Prints one JSON line ``{"rank", "local_rank", "world_size", "node", "launcher"}`` from
:func:`ddpkit.cluster.detect.detect` (the launcher's variables: torchrun's RANK, LOCAL_RANK,
WORLD_SIZE under ``ddpkit run``) and this host's name. For the tests of where a launcher puts
each rank, which need no process group: a rank costs a Python start here, not the
``import torch`` of report_rank.py (~2 CPU-seconds on the test machine), which also forms the
group and all-reduces over it.
"""

from __future__ import annotations

import json
import socket

from ddpkit.cluster.detect import detect


def main() -> None:
    info = detect()
    report = {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "world_size": info.world_size,
        "node": socket.gethostname(),
        "launcher": str(info.launcher),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
