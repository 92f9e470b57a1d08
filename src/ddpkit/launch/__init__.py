"""Starting processes: ``ddpkit run``, torchrun's flags on torch's own elastic agent.

    config      torchrun's flags (and ``PET_*`` fallbacks) -> a typed ``RunConfig``, validated
    local       the launch itself: torch's agent, signal forwarding while it runs
    report      how a launch ended: the root cause of a failure, named for the user
    relay       SIGUSR1/SIGUSR2 from the launcher's first line to its exit (cluster/stop)
    submitit_task  the submitit task runner: the spec's command under the stop signal's hold
    deathsig    the workers die with their launcher, whatever kills it (Linux)
    rdzv_port   in a SLURM job, the c10d rendezvous port searched rather than bet on
    node_order  in a SLURM step, the c10d rendezvous' group ranks in SLURM's node order

This runs in the parent of the workers; what runs inside each worker is :mod:`ddpkit.worker`.
"""
