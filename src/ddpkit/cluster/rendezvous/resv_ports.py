"""``python -m ddpkit.cluster.rendezvous.resv_ports``: the srun flag reserving a step's port.

Job scripts rendered before 2026-11-27 put its output on their ``srun`` line (a requeued job
runs its script as submitted, so it stays); newer ones ask ``scontrol`` in the shell by the same
rule (:func:`ddpkit.cluster.slurmtools.config.has_port_range`; the tests hold the two to the same
answers), without a Python start before the step. Where the cluster has a port range for
reservations (``MpiParams=ports=`` in slurm.conf), it prints ``--resv-ports=1``: SLURM then
gives the step a port that no other step on its nodes holds (``SLURM_STEP_RESV_PORTS``), and
ddpkit hosts the rendezvous there (:mod:`ddpkit.cluster.rendezvous.ports`). Elsewhere it prints
nothing, because srun refuses the flag without that range ("Requires more ports than can be
reserved", SLURM 22.05), and the job falls back on the derived candidate ports. A failing
``scontrol`` also prints nothing: the probe must never stop a job. Imports neither torch nor
pydantic.
"""

from __future__ import annotations

from ddpkit.cluster.slurmtools.config import has_port_range, parse_config, show_config
from ddpkit.cluster.slurmtools.runner import Runner, subprocess_runner

__all__ = ["FLAG", "main", "srun_flag"]

FLAG = "--resv-ports=1"


def srun_flag(config: str) -> str:
    """``--resv-ports=1`` when ``scontrol show config`` text has a port range in MpiParams."""
    return FLAG if has_port_range(parse_config(config)) else ""


def main(runner: Runner = subprocess_runner) -> int:
    """Print the flag (or an empty line); always exit 0 (no SLURM answer: no flag)."""
    print(FLAG if has_port_range(show_config(runner=runner)) else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
