"""The pure parts of preemption: signal names, the requeue cap, the requeue plan, the latch.

``ddpkit.cluster.stop.requeue`` is table-tested on plain mappings; ``ddpkit.cluster.stop.latch`` is
tested in this process with real signals, every handler put back afterwards.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cluster.stop import latch as stopsignal
from ddpkit.cluster.stop.requeue import max_requeues_from, plan_requeue
from ddpkit.cluster.stop.signals import DEFAULT_MAX_REQUEUES, EXIT_STOPPED, parse_signal
from ddpkit.contract import LATCH_DIR_VAR, MAX_REQUEUES_VAR, SIGNAL_VAR
from ddpkit.errors import ConfigError

# ---------------------------------------------------------------------------- parse_signal


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("USR2", signal.SIGUSR2),
        ("SIGUSR2", signal.SIGUSR2),
        ("usr1", signal.SIGUSR1),
        ("sigusr1", signal.SIGUSR1),
        (" USR2 \n", signal.SIGUSR2),
        ("TERM", signal.SIGTERM),
        ("hup", signal.SIGHUP),
        ("XCPU", signal.SIGXCPU),
        ("URG", signal.SIGURG),
        ("INT", signal.SIGINT),
        (str(int(signal.SIGUSR2)), signal.SIGUSR2),
        (int(signal.SIGUSR1), signal.SIGUSR1),
        (signal.SIGUSR2, signal.SIGUSR2),
        (signal.SIGTERM, signal.SIGTERM),
    ],
)
def test_parse_signal_accepts_names_numbers_and_members(value: Any, expected: Any) -> None:
    found = parse_signal(value)
    assert found is expected
    assert isinstance(found, signal.Signals)


@pytest.mark.parametrize(
    "value",
    ["KILL", "SIGKILL", 9, "9", "STOP", "USR3", "SIG", "", "  ", "0", 0, "-12", "USR 2", "1.5"],
)
def test_parse_signal_rejects_with_the_variable_value_and_a_hint(value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_signal(value)
    error = caught.value
    assert error.message.startswith(f"{SIGNAL_VAR}={value!r}"), error.message
    assert error.hint is not None and "USR2" in error.hint and "USR1" in error.hint
    assert "hint:" in str(error)


def test_parse_signal_error_names_the_given_parameter() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_signal("BOGUS", name="signal_name")
    assert caught.value.message.startswith("signal_name='BOGUS'"), caught.value.message
    assert SIGNAL_VAR not in caught.value.message


# ---------------------------------------------------------------------- max_requeues_from


@pytest.mark.parametrize(
    ("value", "env", "expected"),
    [
        (None, {}, DEFAULT_MAX_REQUEUES),
        (None, {MAX_REQUEUES_VAR: ""}, DEFAULT_MAX_REQUEUES),
        (None, {MAX_REQUEUES_VAR: "   "}, DEFAULT_MAX_REQUEUES),
        (None, {MAX_REQUEUES_VAR: "3"}, 3),
        (None, {MAX_REQUEUES_VAR: " 0 "}, 0),
        (None, {MAX_REQUEUES_VAR: "25"}, 25),
        (5, {MAX_REQUEUES_VAR: "3"}, 5),  # the argument wins
        (0, {}, 0),
        (0, {MAX_REQUEUES_VAR: "bogus"}, 0),  # the variable is not even read
        (12, {}, 12),
    ],
)
def test_max_requeues_from_argument_then_variable_then_default(
    value: int | None, env: dict[str, str], expected: int
) -> None:
    assert DEFAULT_MAX_REQUEUES == 10
    assert max_requeues_from(value, env) == expected


@pytest.mark.parametrize("text", ["abc", "-1", "1.5", "3x", "+2", "ten"])
def test_max_requeues_bad_variable_is_a_config_error_naming_it(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        max_requeues_from(None, {MAX_REQUEUES_VAR: text})
    assert caught.value.message.startswith(f"{MAX_REQUEUES_VAR}={text!r}"), caught.value.message
    assert caught.value.hint is not None and MAX_REQUEUES_VAR in caught.value.hint


@pytest.mark.parametrize("value", [-1, -10, True, False, 1.5, "3"])
def test_max_requeues_bad_argument_is_a_config_error(value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        max_requeues_from(value, {})
    assert caught.value.message.startswith(f"max_requeues={value!r}"), caught.value.message
    assert caught.value.hint


# --------------------------------------------------------------------------- plan_requeue


@pytest.mark.parametrize(
    ("env", "cap", "target", "restarts", "why"),
    [
        ({}, 10, None, 0, "not a SLURM job"),
        ({"SLURM_JOB_ID": "  "}, 10, None, 0, "not a SLURM job"),
        ({"SLURM_RESTART_COUNT": "2"}, 10, None, 0, "not a SLURM job"),
        ({"SLURM_JOB_ID": "77"}, 10, "77", 0, "requeue 77 (1 of 10)"),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": ""}, 10, "77", 0, "requeue 77 (1 of 10)"),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "3"}, 10, "77", 3, "requeue 77 (4 of 10)"),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "9"}, 10, "77", 9, "(10 of 10)"),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "10"}, 10, None, 10, "cap reached"),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "11"}, 10, None, 11, "cap reached"),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2"}, 2, None, 2, "max 2"),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}, 2, "77", 1, "(2 of 2)"),
        ({"SLURM_JOB_ID": "77"}, 0, None, 0, "cap reached"),  # 0: never requeue
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "x"}, 10, "77", 0, "(1 of 10)"),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "-3"}, 10, "77", 0, "(1 of 10)"),
        (
            {"SLURM_JOB_ID": "73", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"},
            10,
            "70_3",
            0,
            "requeue 70_3 (1 of 10)",
        ),
        (  # the last task of an array: its job id is the array's, the task id still counts
            {"SLURM_JOB_ID": "70", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "4"},
            10,
            "70_4",
            0,
            "requeue 70_4",
        ),
        ({"SLURM_JOB_ID": "73", "SLURM_ARRAY_JOB_ID": "70"}, 10, "73", 0, "requeue 73"),
        (
            {"SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"},  # no SLURM_JOB_ID
            10,
            None,
            0,
            "not a SLURM job",
        ),
        (
            {
                "SLURM_JOB_ID": "73",
                "SLURM_ARRAY_JOB_ID": "70",
                "SLURM_ARRAY_TASK_ID": "3",
                "SLURM_RESTART_COUNT": "10",
            },
            10,
            None,
            10,
            "cap reached",
        ),
    ],
)
def test_plan_requeue(
    env: dict[str, str], cap: int, target: str | None, restarts: int, why: str
) -> None:
    plan = plan_requeue(env, cap)
    assert plan.target == target, plan
    assert plan.restarts == restarts, plan
    assert why in plan.why, plan
    if target is None and why == "cap reached":
        assert f"SLURM_RESTART_COUNT={restarts}" in plan.why and MAX_REQUEUES_VAR in plan.why


def test_exit_stopped_is_ex_tempfail() -> None:
    assert EXIT_STOPPED == 75


# ----------------------------------------------------------------------------- stopsignal


@pytest.fixture
def saved_handlers() -> Iterator[None]:
    """Put back the handlers of the signals these tests latch, and forget their arrivals."""
    signals = (signal.SIGUSR1, signal.SIGUSR2)
    before = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
            stopsignal.clear(sig)
            stopsignal._LATCHED.discard(int(sig))


def _wait_received(sig: signal.Signals, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not stopsignal.received(sig) and time.monotonic() < deadline:
        time.sleep(0.001)
    return stopsignal.received(sig)


@pytest.mark.usefixtures("saved_handlers")
def test_latch_records_the_signal_and_clear_forgets_it() -> None:
    stopsignal.clear(signal.SIGUSR2)
    assert stopsignal.latch(signal.SIGUSR2) is True
    assert signal.getsignal(signal.SIGUSR2) is stopsignal._record
    assert not stopsignal.received(signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGUSR2)  # the default action would end pytest
    assert _wait_received(signal.SIGUSR2)
    assert not stopsignal.received(signal.SIGUSR1)  # only the signal that came
    stopsignal.clear(signal.SIGUSR2)
    assert not stopsignal.received(signal.SIGUSR2)
    assert stopsignal.latch(signal.SIGUSR2) is True  # latching twice keeps the one handler
    os.kill(os.getpid(), signal.SIGUSR2)
    assert _wait_received(signal.SIGUSR2)


@pytest.mark.usefixtures("saved_handlers")
def test_latch_from_env_without_the_variable_changes_nothing() -> None:
    before = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGUSR1)
    assert stopsignal.latch_from_env({}) is None
    assert stopsignal.latch_from_env({SIGNAL_VAR: "  "}) is None
    assert (signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGUSR1)) == before


@pytest.mark.usefixtures("saved_handlers")
def test_latch_from_env_latches_the_named_signal() -> None:
    usr2_before = signal.getsignal(signal.SIGUSR2)
    assert stopsignal.latch_from_env({SIGNAL_VAR: "usr1"}) is signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is stopsignal._record
    assert signal.getsignal(signal.SIGUSR2) is usr2_before  # the other one untouched
    os.kill(os.getpid(), signal.SIGUSR1)
    assert _wait_received(signal.SIGUSR1)
    assert not stopsignal.received(signal.SIGUSR2)


@pytest.mark.usefixtures("saved_handlers")
def test_latch_from_env_rejects_a_bad_signal_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match=SIGNAL_VAR):
        stopsignal.latch_from_env({SIGNAL_VAR: "KILL"})


@pytest.mark.usefixtures("saved_handlers")
def test_latch_outside_the_main_thread_is_refused() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    results: list[Any] = []
    thread = threading.Thread(
        target=lambda: results.append(
            (stopsignal.latch(signal.SIGUSR2), stopsignal.latch_from_env({SIGNAL_VAR: "USR2"}))
        )
    )
    thread.start()
    thread.join(timeout=10)
    assert results == [(False, None)]
    assert signal.getsignal(signal.SIGUSR2) is before


@pytest.mark.usefixtures("saved_handlers")
def test_latch_unblocks_the_signal_and_records_one_that_was_pending() -> None:
    # A parent that starts the process with the signal blocked (RunCommand) loses nothing.
    stopsignal.clear(signal.SIGUSR2)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    try:
        # To this thread, which blocks it: pending, whatever the handler. (os.kill would let the
        # kernel pick another thread of pytest's that does not block it: default action, death.)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
        assert signal.SIGUSR2 in signal.sigpending()
        assert stopsignal.latch(signal.SIGUSR2)
        assert signal.SIGUSR2 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert _wait_received(signal.SIGUSR2)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR2])


@pytest.mark.usefixtures("saved_handlers")
def test_latch_from_env_announces_this_process_in_the_latch_dir(tmp_path: Path) -> None:
    env = {SIGNAL_VAR: "USR2", LATCH_DIR_VAR: str(tmp_path)}
    assert stopsignal.latch_from_env(env) is signal.SIGUSR2
    assert os.listdir(tmp_path) == [f"{socket.gethostname()}.{os.getpid()}"]
    assert stopsignal.latch_from_env(env) is signal.SIGUSR2  # again: the same marker
    assert len(os.listdir(tmp_path)) == 1


@pytest.mark.usefixtures("saved_handlers")
def test_latch_from_env_warns_when_it_cannot_announce(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.warns(RuntimeWarning, match=f"cannot create {missing}/.*hold the stop signal"):
        assert stopsignal.latch_from_env({SIGNAL_VAR: "USR2", LATCH_DIR_VAR: str(missing)})
    assert signal.getsignal(signal.SIGUSR2) is stopsignal._record  # latched all the same


# The interpreter's finalization runs after the atexit handlers: an object collected then
# (module teardown) signals its own process, as a late SLURM warning would.
_LATE_SIGNAL = """
import os, signal, sys, time
from ddpkit.cluster.stop import latch as stopsignal
from ddpkit.contract import LATCH_DIR_VAR

class Late:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)  # a default action would have ended the process by now
        sys.stderr.write("survived\\n")

late = Late()
stopsignal.latch_from_env({"DDPKIT_SIGNAL": "USR2"})
print("exiting", flush=True)
"""


def test_the_latched_signal_cannot_kill_the_process_during_finalization() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LATE_SIGNAL],
        env={**os.environ, "PYTHONPATH": str(Path(stopsignal.__file__).parents[3])},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "exiting\n", "survived\n")
