"""Torch-free twin of report_port.py for the ``launch: torchrun`` port tests: the rank the
agents gave this process and the ports it saw, without joining a group.

Prints one JSON line ``{"rank", "world_size", "node", "master_port", "resv_ports", "ddpkit"}``
(report_port.py's, less ``sum``). Under torchrun the ports under test are the agents'
(``ddpkit run``'s c10d rendezvous, which their log lines name): the ranks it placed are what a
worker can report, at a Python start instead of an ``import torch`` (~2 CPU-seconds a rank on
the test machine). A group formed over ports SLURM reserved or past taken ones is
report_port.py's, in the ``launch: srun`` tests.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from ddpkit.cluster.detect import detect


def main() -> None:
    info = detect()
    report = {
        "rank": info.rank,
        "world_size": info.world_size,
        "node": socket.gethostname(),
        "master_port": info.master_port,
        "resv_ports": os.environ.get("SLURM_STEP_RESV_PORTS"),
        "ddpkit": sys.modules["ddpkit"].__file__,  # where the package was imported from
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
