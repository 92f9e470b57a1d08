"""The stop signal's one home, torch-free: every process of a job imports it from here.

    signals   the vocabulary and defaults; the one parser and reader of ``DDPKIT_SIGNAL``
    latch     in a worker: a handler that records the signal from ``ddpkit.init()`` to exit
    requeue   the requeue rules: the cap, the job to requeue (pure)
    forward   hold-and-forward: block the signal, pass each arrival on to the children
    hold      ``python -m ddpkit.cluster.stop.hold COMMAND...``: a command run under
              hold-and-forward (each srun task of an sbatch job; submitit's task runner)
    health    ``python -m ddpkit.cluster.stop.health``: a spec's health check on one node
    exclude   ``python -m ddpkit.cluster.stop.exclude``: excludes the nodes whose check failed
              (or that the watchdog blamed: ``blamed``) and requeues the job, up to a cap

The torch side, ``ddpkit.preemption_guard()`` (:mod:`ddpkit.worker.preempt`), and the
launcher's (:mod:`ddpkit.launch.relay`) build on these. Importing this package imports nothing.
"""
