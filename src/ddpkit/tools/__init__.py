"""The diagnosis tools: ``ddpkit env`` (one report for a bug) and ``ddpkit doctor`` (checks).

netinfo     interfaces, the route to an address, the interface gloo / NCCL would use
envreport   the ``ddpkit env`` report: versions, GPUs, launcher, variables (masked), network;
            only its ``backends`` section imports torch
doctor_checks  the doctor's checks as pure functions over gathered facts, one ``Check`` each;
            its options and report
doctor      gathers each rank's facts, meets the other ranks through a bounded store,
            runs the checks and the communication test, prints one line per check
commtest    the all_reduce sweep (latency, algbw, busbw as nccl-tests) and its references
            (a loopback memcpy, a raw socket transfer between two ranks): the doctor's last step
"""
