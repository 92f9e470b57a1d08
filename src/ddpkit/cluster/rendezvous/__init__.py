"""Where a job meets, decided without torch (ports, endpoint, reserved ports, name lookups).

The job scripts run its entry points on the critical path of every job start, so it imports
neither torch nor pydantic; hosting, joining and searching the store live in
:mod:`ddpkit.worker.rendezvous`.
"""
