"""``python -m ddpkit.cluster.rendezvous.resv_ports``: the srun flag reserving a step's port.

The job scripts put its output on their ``srun`` line. Where the cluster has a port range for
reservations (``MpiParams=ports=`` in slurm.conf), it prints ``--resv-ports=1``: SLURM then
gives the step a port that no other step on its nodes holds (``SLURM_STEP_RESV_PORTS``), and
ddpkit hosts the rendezvous there (:mod:`ddpkit.cluster.rendezvous.ports`). Elsewhere it prints
nothing, because srun refuses the flag without that range ("Requires more ports than can be
reserved", SLURM 22.05), and the job falls back on the derived candidate ports. A failing
``scontrol`` also prints nothing: the probe must never stop a job. Imports neither torch nor
pydantic.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

__all__ = ["FLAG", "main", "srun_flag"]

FLAG = "--resv-ports=1"


def srun_flag(config: str) -> str:
    """``--resv-ports=1`` when ``scontrol show config`` text has a port range in MpiParams."""
    for line in config.splitlines():
        name, _, value = line.partition("=")
        if name.strip().lower() == "mpiparams" and "ports=" in value.lower():
            return FLAG
    return ""


def _scontrol_config(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def main(scontrol: Sequence[str] = ("scontrol", "show", "config")) -> int:
    """Print the flag (or an empty line); always exit 0."""
    print(srun_flag(_scontrol_config(scontrol)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
