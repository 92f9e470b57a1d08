"""Store calls naming many keys, in slices: against a real TCPStore, the same answers as one
call, and never more than ``KEYS_PER_CALL`` keys a call."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore

from ddpkit.worker.rendezvous import batched


class Widest:
    """A real store noting how many keys each of its calls named."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)

        def noted(keys: list[str], *rest: Any) -> Any:
            self.calls.append((name, len(keys)))
            return attr(keys, *rest)

        return noted


@pytest.fixture
def store() -> Widest:
    host = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    return Widest(host)


@pytest.mark.parametrize("count", [1, 1024, 1025, 2500])
def test_many_keys_are_written_checked_and_read_a_slice_at_a_time(
    store: Widest, count: int
) -> None:
    keys = [f"k/{i}" for i in range(count)]
    batched.multi_set(store, keys, [str(i) for i in range(count)])
    assert batched.check(store, keys)
    assert batched.multi_get(store, keys) == [str(i).encode() for i in range(count)]
    slices = math.ceil(count / batched.KEYS_PER_CALL)
    for name in ("multi_set", "check", "multi_get"):
        widths = [width for called, width in store.calls if called == name]
        assert len(widths) == slices and max(widths) <= batched.KEYS_PER_CALL, (name, widths)
        assert sum(widths) == count


def test_a_key_missing_from_any_slice_fails_the_check(store: Widest) -> None:
    keys = [f"k/{i}" for i in range(2500)]
    batched.multi_set(store, keys[:2499], ["1"] * 2499)
    assert not batched.check(store, keys)  # the last slice lacks k/2499
    assert batched.check(store, keys[:2499])


def test_no_keys_make_no_call_and_mismatched_values_are_refused(store: Widest) -> None:
    assert batched.multi_get(store, []) == []
    assert batched.check(store, [])
    batched.multi_set(store, [], [])
    assert store.calls == []
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        batched.multi_set(store, ["a", "b"], ["1"])
    assert store.calls == []


def test_the_keys_present_take_a_call_a_slice_and_a_key_at_a_time_only_where_one_is_missing(
    store: Widest,
) -> None:
    keys = [f"k/{i}" for i in range(2500)]
    batched.multi_set(store, keys, ["1"] * 2500)
    store.calls.clear()
    assert batched.present(store, keys) == list(range(2500))
    assert store.calls == [("check", 1024), ("check", 1024), ("check", 452)]
    store.calls.clear()
    missing = {5, 1500, 1501}
    gappy = [f"gap/{i}" if i in missing else key for i, key in enumerate(keys)]
    assert batched.present(store, gappy) == [i for i in range(2500) if i not in missing]
    # the two slices with a key missing, a key at a time; the last one in one call
    assert len(store.calls) == 1 + 1024 + 1 + 1024 + 1
    assert batched.present(store, []) == []
