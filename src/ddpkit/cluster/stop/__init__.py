"""The stop signal's one home, torch-free: every process of a job imports it from here.

    signals   the vocabulary and defaults: which signals ddpkit stops on, which a job spec
              takes, the default, the requeue cap; the one parser and the one reader of
              ``DDPKIT_SIGNAL``
    latch     in a worker: a handler that records the signal from ``ddpkit.init()`` to exit
    requeue   the requeue rules: the cap, the job to requeue (pure)
    forward   hold-and-forward: block the signal, and pass each arrival on to this process's
              children (kept while none runs); a child starts with it blocked, so it stays
              pending there until the child latches it (``ddpkit run`` outside a job: the
              children start with it unblocked, and get it once they catch it)
    hold      ``python -m ddpkit.cluster.stop.hold COMMAND...``: a command run under
              hold-and-forward (each srun task of an sbatch job; submitit's task runner)
    health    ``python -m ddpkit.cluster.stop.health``: a spec's health check on one node,
              reported as one JSON line
    exclude   ``python -m ddpkit.cluster.stop.exclude``: blames the nodes whose check failed,
              excludes them (``scontrol update ExcNodeList``) and requeues the job, up to a cap

The torch side, ``ddpkit.preemption_guard()`` (:mod:`ddpkit.worker.preempt`), and the
launcher's (:mod:`ddpkit.launch.relay`) build on these. Importing this package imports nothing.
"""
