"""``python -m ddpkit.jobs.resv_ports``: the old path of
:mod:`ddpkit.cluster.rendezvous.resv_ports`.

Kept only as an entry point: a job script rendered before the move calls this path on its
``srun`` line, and a requeued job re-runs its old script against the installed ddpkit, so
removing it would fail that job at its restart. It runs the new module's ``main`` and nothing
else (importing it defines nothing); new scripts call
``python -m ddpkit.cluster.rendezvous.resv_ports``.
"""

from __future__ import annotations

if __name__ == "__main__":
    from ddpkit.cluster.rendezvous.resv_ports import main

    raise SystemExit(main())
