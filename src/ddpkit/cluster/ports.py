"""``from ddpkit.cluster.ports import port_for_job``: the old path of
:func:`ddpkit.cluster.rendezvous.ports.port_for_job`.

Kept only for torchx jobs submitted before the move: their app's command runs
``python -c 'from ddpkit.cluster.ports import port_for_job; ...'`` to derive the rendezvous
port, and a requeued or retried job re-runs that command against the installed ddpkit. New
app definitions import :mod:`ddpkit.cluster.rendezvous.ports`. Nothing else is here.
"""

from __future__ import annotations

from ddpkit.cluster.rendezvous.ports import port_for_job

__all__ = ["port_for_job"]
