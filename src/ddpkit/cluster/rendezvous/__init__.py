"""Where a job meets, decided without torch: the torch-free half of ddpkit's rendezvous.

    ports       the deterministic ports of a job/step, the step's reserved port, the ordered
                :class:`~ddpkit.cluster.rendezvous.ports.PortSearch`, a free port
    endpoint    ``python -m ddpkit.cluster.rendezvous.endpoint``: the c10d ``host:port`` of a
                SLURM job, and which node hosts its store
    resv_ports  ``python -m ddpkit.cluster.rendezvous.resv_ports``: the srun flag reserving a
                step's port where the cluster has a port range
    lookup      how long the resolver takes to name this host's address, as torch's store
                client asks when it connects (10 s where DNS does not answer)

This half decides *where* (addresses, ports, identities, from a snapshot of the environment)
and imports neither torch nor pydantic: the job scripts run the two entry points on the
critical path of every job start. Hosting, joining and searching the store itself need torch
and live in :mod:`ddpkit.worker.rendezvous`.
"""
