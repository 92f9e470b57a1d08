"""What the rendezvous leaves running at exit: nothing.

A rank's store connect runs in the rank's own thread, bounded without one
(:func:`ddpkit.worker.rendezvous.store.store_answers`), so no thread of the rendezvous can be
inside torch's C++ code when the interpreter finalizes. :func:`_wait_for_pending` is kept for
the exit path that calls it, and returns at once; it goes with that call.
"""

from __future__ import annotations

__all__: list[str] = []


def _wait_for_pending() -> None:
    """Nothing to wait for (see the module docstring)."""
