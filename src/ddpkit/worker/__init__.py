"""Everything a training script calls inside a worker process.

    context        init() / current() / shutdown(): detect, choose the device, join the group
    process_group  joining the group: backend, timeouts, init_process_group, GPU check
    rendezvous/    the store: where it listens, the port search, every connect bounded
    wrap           DDP, DataParallel or the plain model
    placement      the pure decision for a model split across devices (kept, never moved)
    dataparallel   nn.DataParallel with ddpkit's scatter, threads and gather; balanced_loss
    structure      split / concat / combine for any structure (pure, tested on CPU)
    state_dict     unwrap, clean_state_dict, load_state_dict: one format across modes
    loader         per-rank shards whose epoch advances by itself; resumable; the active pass
    gather         every rank's rows of an evaluation step, padding duplicates removed
    accumulate     gradient accumulation windows: the sync skipped but on the last micro-step
    clip           clip_grad_norm_: the norm of the gradient the optimizer takes, global
    metrics        reduce and Mean: metrics across ranks, the sampler's padding left out
    checkpoint     atomic, collective save / load with every rank's RNG state
    asyncsave      async_save_checkpoint: the state copied, written by a thread
    inflight       the one background write: bounded waits, its failure on every rank
    ckptfiles      a checkpoint folder's files and write order, read without unpickling
    safeload       which checkpoint a load restores, read weights_only (an allow-list)
    durable        atomic writes; dead writers' temporary files; the disk-full error
    preempt        the guard: one agreed stop, a checkpoint, requeue or exit 75
    watchdog/      the peer watchdog: a dead or frozen rank is named, survivors end
    exit           the one exit path: ddpkit's at-exit steps, in order, from one handler
    rankzero       printing, logging and seeding on the main rank

The public names are re-exported by :mod:`ddpkit` (``ddpkit.init``, ``ddpkit.wrap``, ...).
Importing this package imports nothing else. The stop signal's torch-free parts (latch, requeue
rules, hold-and-forward) are :mod:`ddpkit.cluster.stop`'s; the guard here builds on them.
"""
