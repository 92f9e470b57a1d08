"""``python -m ddpkit.cluster.rendezvous.resv_ports``: the srun flag reserving a step's port.

Kept for job scripts rendered before 2026-11-27, which put its output on their ``srun`` line
(a requeued job runs its script as submitted); newer ones ask ``scontrol`` in the shell by the
same rule (:func:`ddpkit.cluster.slurmtools.config.has_port_range`). It prints
``--resv-ports=1`` where the cluster has a port range for reservations (``MpiParams=ports=``),
else nothing: srun refuses the flag without one, and the probe must never stop a job.
"""

from __future__ import annotations

from ddpkit.cluster.slurmtools.config import has_port_range, show_config
from ddpkit.cluster.slurmtools.runner import Runner, subprocess_runner

__all__ = ["FLAG", "main"]

FLAG = "--resv-ports=1"


def main(runner: Runner = subprocess_runner) -> int:
    """Print the flag (or an empty line); always exit 0 (no SLURM answer: no flag)."""
    print(FLAG if has_port_range(show_config(runner=runner)) else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
