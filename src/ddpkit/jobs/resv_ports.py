"""``python -m ddpkit.jobs.resv_ports``: the old path of
:mod:`ddpkit.cluster.rendezvous.resv_ports`.

Kept as an entry point only: a requeued job re-runs the script rendered before the move, which
calls this path on its ``srun`` line, against the installed ddpkit. Importing it defines nothing.
"""

from __future__ import annotations

if __name__ == "__main__":
    from ddpkit.cluster.rendezvous.resv_ports import main

    raise SystemExit(main())
