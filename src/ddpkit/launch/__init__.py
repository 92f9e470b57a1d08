"""Starting processes: ``ddpkit run``, torchrun's flags on torch's own elastic agent.

    config      torchrun's flags (and ``PET_*`` fallbacks) -> a typed ``RunConfig``, validated
    local       the launch itself: torch's agent, signal forwarding, the root-cause report
    rdzv_port   in a SLURM job, the c10d rendezvous port searched rather than bet on
    node_order  in a SLURM step, the c10d rendezvous' group ranks in SLURM's node order

This runs in the parent of the workers; what runs inside each worker is :mod:`ddpkit.worker`.
"""
