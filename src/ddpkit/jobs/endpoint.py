"""``python -m ddpkit.jobs.endpoint``: the old path of :mod:`ddpkit.cluster.rendezvous.endpoint`.

Kept as an entry point only: a requeued job re-runs the script rendered before the move, which
calls this path, against the installed ddpkit. Importing it defines nothing.
"""

from __future__ import annotations

if __name__ == "__main__":
    from ddpkit.cluster.rendezvous.endpoint import main

    raise SystemExit(main())
