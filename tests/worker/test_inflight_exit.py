"""The background write's exit step stays within the bound the user set: on every rank, the
waits of :func:`ddpkit.worker.inflight._at_exit` add up to at most the save's ``timeout_s``.

In-process, with a store that records each wait instead of waiting (the real multi-rank exits,
failing and succeeding, are in ``test_checkpoint_async_ranks.py``); the write is a thread that
never finishes, so every wait runs to its bound.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest

from ddpkit.worker import inflight


class _Store:
    """The calls ``_share_at_exit`` makes, recorded; ``add`` of the read counter says no rank
    read yet, so the main rank waits its whole bound (on the clock the test moves)."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.values: dict[str, str] = {}
        self.waits: list[float] = []

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values.get(key, "").encode()

    def add(self, key: str, amount: int) -> int:
        return 0

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.waits.append(timeout.total_seconds())
        self.values.setdefault(keys[0], "")


@pytest.mark.parametrize("timeout_s", [1.0, 20.0, 300.0, 3600.0])
@pytest.mark.parametrize("rank", [0, 1])
def test_every_ranks_exit_step_ends_within_the_saves_timeout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int, timeout_s: float
) -> None:
    clock = [0.0]
    store = _Store(clock)
    waited: list[float] = []
    never = threading.Event()

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    def done_wait(seconds: float | None = None) -> bool:  # the write never finishes
        waited.append(seconds or 0.0)
        clock[0] += seconds or 0.0
        return never.is_set()

    monkeypatch.setattr(inflight.compat, "default_store", lambda: store)
    monkeypatch.setattr(inflight.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(inflight.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(inflight.time, "sleep", sleep)
    pending = inflight._Write(5, tmp_path, timeout_s, rank, 2, generation=1)
    if rank == 0:
        pending.thread = threading.Thread(target=lambda: None)
        monkeypatch.setattr(pending.done, "wait", done_wait)
    monkeypatch.setattr(inflight, "_STATE", inflight._State(pending=pending))

    code = inflight._at_exit()

    total = clock[0] + sum(store.waits)
    assert total <= timeout_s + 1e-6, (waited, store.waits, clock[0])
    if rank == 0:
        assert code == 1  # the write did not finish in time: an error, said on every rank
        assert waited and waited[0] < timeout_s  # the others' reading has its share of it
        assert store.values["ddpkit/checkpoint-write/1"].startswith("timeout\0")
        assert f"within {timeout_s:g} s" in store.values["ddpkit/checkpoint-write/1"]
    else:
        assert store.waits == [timeout_s]  # the whole bound, not more
        assert code is None  # the main rank said the write succeeded (an empty outcome)
