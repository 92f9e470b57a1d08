"""ddpkit.jobs.interrupts: SIGINT and SIGTERM held over a submission, then raised again.

Real signals, raised in this process (the main thread, where pytest runs): what a hold keeps,
what it gives back and when, and where it holds nothing.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import pytest

from ddpkit.jobs.interrupts import held_stop_signals

pytestmark = pytest.mark.usefixtures("signals_put_back")


def test_a_ctrl_c_in_the_block_lets_it_finish_then_interrupts() -> None:
    done: list[str] = []
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with held_stop_signals():
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")
        done.append("after the block")  # not reached: the signal comes back as the block ends
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is before


def test_a_sigterm_is_given_back_to_the_handler_that_was_in_place() -> None:
    got: list[int] = []

    def mine(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    signal.signal(signal.SIGTERM, mine)
    with held_stop_signals():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert got == []  # held
    assert got == [signal.SIGTERM]  # the first one, once, after the block
    assert signal.getsignal(signal.SIGTERM) is mine


def test_an_error_in_the_block_is_what_ends_it_not_the_signal() -> None:
    with pytest.raises(RuntimeError, match="sbatch refused"), held_stop_signals():
        signal.raise_signal(signal.SIGINT)
        raise RuntimeError("sbatch refused")


def test_holds_nest_the_inner_hands_what_it_held_to_the_outer() -> None:
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt), held_stop_signals():
        with held_stop_signals():
            signal.raise_signal(signal.SIGINT)
            done.append("inner")
        done.append("outer")  # the job id is printed here, after the record
    assert done == ["inner", "outer"]


def test_nothing_is_held_when_disabled_or_off_the_main_thread() -> None:
    with pytest.raises(KeyboardInterrupt), held_stop_signals(enabled=False):
        signal.raise_signal(signal.SIGINT)
        pytest.fail("not held: the signal raises at once")
    seen: list[object] = []

    def elsewhere() -> None:
        with held_stop_signals():  # signal.signal would raise ValueError off the main thread
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join(10)
    assert seen == [signal.default_int_handler]
