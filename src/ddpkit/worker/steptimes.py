"""Per-rank step and data-wait times, for the straggler report (:mod:`.watchdog.straggler`).

``ddpkit.loader``'s iterator calls :meth:`StepTimes.batch` around each batch it fetches: the
time inside the fetch is this rank's data wait, the time from one batch to the next is its
step. ``ddpkit.wrap`` hands over the DDP model it made (:func:`watch_model`); every
``COMPUTE_EVERY`` batches the loader reads DDP's own measure of this rank's forward and
backward compute (DDP samples it anyway, CUDA events on GPUs), from the training thread, where
DDP writes it. Nothing here waits or talks to other ranks: the watchdog's threads read
:meth:`StepTimes.totals` and share them over the store. Cost per batch: two clock reads.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

COMPUTE_EVERY = 100  # batches between reads of DDP's compute figures


class StepTimes:
    """Running totals of this rank's batches (read from another thread under a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0  # batches fetched
        self.data_s = 0.0  # time inside the fetches
        self.step_s = 0.0  # time from one fetch's end to the next one's end
        self.compute_s: float | None = None  # DDP's forward + backward compute per step
        self._last_end: float | None = None
        self._model: weakref.ReferenceType[Any] | None = None

    def batch(self, started: float, ended: float) -> None:
        """One batch fetched between ``started`` and ``ended`` (``time.perf_counter``)."""
        with self._lock:
            self.steps += 1
            self.data_s += ended - started
            if self._last_end is not None:
                self.step_s += ended - self._last_end
            self._last_end = ended
        if self.steps % COMPUTE_EVERY == 0:
            self._read_compute()

    def pass_ended(self) -> None:
        """The pass ended: the time until the next pass's first batch is not a step."""
        with self._lock:
            self._last_end = None

    def watch_model(self, model: Any) -> None:
        self._model = weakref.ref(model)

    def totals(self) -> dict[str, Any]:
        with self._lock:
            return {"steps": self.steps, "data_s": self.data_s, "step_s": self.step_s,
                    "compute_s": self.compute_s}  # fmt: skip

    def _read_compute(self) -> None:
        model = self._model() if self._model is not None else None
        if model is None:
            return
        from ddpkit.compat import ddp_compute_s

        value = ddp_compute_s(model)
        with self._lock:
            self.compute_s = value


TIMES = StepTimes()


def batch_clock() -> float:
    return time.perf_counter()
