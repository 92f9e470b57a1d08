"""Joining a job's rendezvous store (torch): hosting, the port search and every bounded connect.

    store       where the store listens, hosting it, every connect bounded (a listener that
                is no store becomes a one-line error, not a hang)
    portsearch  a SLURM step without MASTER_PORT: host on the first port that binds, find the
                store that answers with the job's identity
    group       the store of a process group: which one each rank makes or reaches
    batched     store calls naming many keys, in slices (torch's cost grows faster than N)

Where the job meets is decided torch-free in :mod:`ddpkit.cluster.rendezvous`.
"""
