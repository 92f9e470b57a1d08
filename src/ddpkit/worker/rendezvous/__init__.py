"""Joining a job's rendezvous store (torch): the half of ddpkit's rendezvous that talks to it.

    store       where the store listens (loopback when the job allows it), hosting it, and
                every connect bounded, in the rank's own thread (a listener that is no store
                becomes a one-line error, not a hang)
    portsearch  a SLURM step without MASTER_PORT: host on the first candidate port that binds,
                find the store that answers with the job's identity
    group       the store of a process group: which one each rank makes or reaches
    batched     store calls naming many keys, in slices (torch's cost grows faster than N)

Where the job meets (ports, endpoint, reserved ports) is decided torch-free in
:mod:`ddpkit.cluster.rendezvous`; this half hosts, searches and joins. Users:
:mod:`ddpkit.worker.process_group` (``ddpkit.init``), ``ddpkit run``'s c10d port
(:mod:`ddpkit.launch.rdzv_port`) and ``ddpkit doctor`` (:mod:`ddpkit.tools.meeting`).
"""
