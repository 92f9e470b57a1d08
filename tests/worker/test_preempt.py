"""ddpkit.preemption_guard on real gloo groups: one agreed stop, then requeue or exit code 75.

Each world size forms one group (spawned workers, 127.0.0.1) and plays several scenarios in
it, each with a fresh guard: one rank sends itself SIGUSR2 at step SIGNAL_STEP, and every rank
records the step at which ``should_stop()`` first said True. The requeue scenarios end the
group (``requeue_and_exit`` shuts ddpkit down), so every rank joins a new group on a fresh port
for the next one. ``scontrol`` is a fake script put first on PATH inside the workers only; it
appends its arguments to a file, so the file says whether and how often it ran.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpkit
from ddpkit.cluster.stop import latch as stopsignal
from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker import preempt
from ddpkit.worker.context import current_or_none
from tests.fakes.slurm import FakeTools
from tests.support.distutil import free_port, run_workers, torchrun_env

pytestmark = pytest.mark.multiproc

SIGNAL_STEP = 7
STEPS = 20
TIMEOUT_S = 90.0
INIT = {"backend": "gloo", "timeout_s": 20.0, "peer_timeout_s": 20.0}


def _loop(rank: int, signal_rank: int, check_every: int) -> dict[str, Any]:
    """Steps 1..STEPS; ``signal_rank`` signals itself at SIGNAL_STEP; where did it stop?"""
    stopsignal.clear(signal.SIGUSR2)
    guard = ddpkit.preemption_guard(check_every=check_every, env={})
    received_before: list[bool] = []
    stopped_at = received = None
    for step in range(1, STEPS + 1):
        if rank == signal_rank and step == SIGNAL_STEP:
            os.kill(os.getpid(), signal.SIGUSR2)
            deadline = time.monotonic() + 5  # the handler runs at once on Linux; be sure
            while not guard.received and time.monotonic() < deadline:
                time.sleep(0.001)
        received_before.append(guard.received)
        if guard.should_stop():
            stopped_at, received = step, guard.received
            break
    # Once agreed, it stays True with no further collective: a lone rank can ask again.
    again = [guard.should_stop() for _ in range(3)] if rank == 0 else []
    stopsignal.clear(signal.SIGUSR2)
    return {
        "stopped_at": stopped_at,
        "received": received,
        "received_before": received_before,
        "again": again,
    }


def _stop_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    ddpkit.init(env=torchrun_env(rank, world_size, port), **INIT)
    try:
        found = {}
        for signal_rank in (0, world_size - 1):
            found[f"signal-{signal_rank}"] = _loop(rank, signal_rank, check_every=1)
        found["every-3"] = _loop(rank, world_size - 1, check_every=3)
        return found
    finally:
        ddpkit.shutdown()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def stops(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world_size: int = request.param
    return world_size, run_workers(_stop_worker, world_size, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("who", ["first", "last"])
def test_every_rank_stops_after_the_step_one_rank_got_the_signal(
    stops: tuple[int, list[dict[str, Any]]], who: str
) -> None:
    world_size, results = stops
    signal_rank = 0 if who == "first" else world_size - 1
    seen = [result[f"signal-{signal_rank}"] for result in results]
    assert [s["stopped_at"] for s in seen] == [SIGNAL_STEP] * world_size, seen
    for rank, result in enumerate(seen):
        assert result["received"] is (rank == signal_rank), (rank, result)
        # nobody had it before the step it was sent at
        assert not any(result["received_before"][: SIGNAL_STEP - 1]), (rank, result)
    assert seen[0]["again"] == [True, True, True]


def test_check_every_agrees_only_on_every_nth_call(
    stops: tuple[int, list[dict[str, Any]]],
) -> None:
    world_size, results = stops
    seen = [result["every-3"] for result in results]
    agreed = -(-SIGNAL_STEP // 3) * 3  # the first multiple of 3 at or after the signal: 9
    assert [s["stopped_at"] for s in seen] == [agreed] * world_size, seen
    last = seen[-1]
    # the signalled rank knew from SIGNAL_STEP on, yet kept going until the agreement
    assert last["received_before"][SIGNAL_STEP - 1 :] == [True] * (agreed - SIGNAL_STEP + 1)
    for result in seen[:-1]:
        assert result["received"] is False, seen


# ------------------------------------------------------------------------ requeue_and_exit

# name: (guard env, fake scontrol exit code or None for no scontrol on PATH)
SCENARIOS: dict[str, tuple[dict[str, str], int | None]] = {
    "no-slurm": ({"SLURM_RESTART_COUNT": "0"}, 0),
    "job": ({"SLURM_JOB_ID": "77"}, 0),
    "array": ({"SLURM_JOB_ID": "73", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"}, 0),
    "cap": ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "10"}, 0),
    "fails": ({"SLURM_JOB_ID": "77"}, 1),
    # no peer watchdog, whose stop (a thread join, without the GIL) comes between the
    # requeue's last collective and the group's destruction and lets gloo's thread finish
    "no-watchdog": ({"SLURM_RESTART_COUNT": "0"}, 0),
}


def _requeue_worker(
    rank: int, world_size: int, port: int, ports: list[int], root: str
) -> dict[str, Any]:
    path = os.environ.get("PATH", "")
    found: dict[str, Any] = {}
    for (name, (env, code)), group_port in zip(SCENARIOS.items(), [port, *ports], strict=True):
        bin_dir = Path(root) / name
        if rank == 0 and code is not None:
            FakeTools(bin_dir).scontrol_exits(code)
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{path}"  # this spawned worker only
        init = {**INIT, "peer_timeout_s": 0.0} if name == "no-watchdog" else INIT
        ddpkit.init(env=torchrun_env(rank, world_size, group_port), **init)  # a barrier too
        guard = ddpkit.preemption_guard(env=env)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                _step_then_requeue(guard)
            except SystemExit as exc:
                exit_code: Any = exc.code
            else:  # pragma: no cover - requeue_and_exit is NoReturn
                exit_code = "returned"
        found[name] = {
            "code": exit_code,
            "stderr": err.getvalue(),
            "initialized": current_or_none() is not None,
        }
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a requeue ignores it from then on
    return found


def _step_then_requeue(guard: preempt.PreemptionGuard) -> None:
    """A training frame: a DDP model that has just all-reduced its gradients, then the
    requeue, whose SystemExit frees the model on its way out. With the group destroyed just
    before, the model's Reducer must not hold the group's last reference: torch would free it
    with the GIL held and deadlock against gloo's thread (no rank would ever return)."""
    model = ddpkit.wrap(torch.nn.Linear(8, 8))
    model(torch.ones(4, 8)).sum().backward()
    guard.requeue_and_exit()


@pytest.fixture(scope="module")
def requeues(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("scontrol")
    ports = [free_port() for _ in range(len(SCENARIOS) - 1)]
    return root, run_workers(_requeue_worker, 2, ports, str(root), timeout_s=TIMEOUT_S)


def _calls(root: Path, name: str) -> list[str] | None:
    return FakeTools(root / name).scontrol_calls()


def test_outside_slurm_every_rank_exits_75_saying_why(
    requeues: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = requeues
    seen = [result["no-slurm"] for result in results]
    assert [s["code"] for s in seen] == [75, 75], seen
    assert "not a SLURM job" in seen[0]["stderr"], seen
    assert "not requeued" in seen[0]["stderr"], seen
    assert seen[1]["stderr"] == "", seen  # only the main rank speaks
    assert not any(s["initialized"] for s in seen), seen  # ddpkit was shut down
    assert _calls(root, "no-slurm") is None  # scontrol was on PATH and never ran


def test_a_ddp_model_freed_as_the_requeue_ends_the_rank_does_not_hang_it(
    requeues: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Every scenario's rank had a DDP model in its frame (``_step_then_requeue``); the one
    without a watchdog destroys the group right after the last collective, as plain torch would:
    the model freed then must not deadlock in torch's Reducer (a hang fails the launch)."""
    _, results = requeues
    seen = [result["no-watchdog"] for result in results]
    assert [s["code"] for s in seen] == [75, 75], seen
    assert not any(s["initialized"] for s in seen), seen


def test_slurm_job_is_requeued_once_by_rank_0_and_every_rank_exits_0(
    requeues: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = requeues
    seen = [result["job"] for result in results]
    assert [s["code"] for s in seen] == [0, 0], seen
    assert _calls(root, "job") == ["requeue 77"]
    # said before the requeue, which cancels the job's steps and cuts their output
    assert "requeue 77 (1 of 10): asking SLURM to put the job back" in seen[0]["stderr"], seen
    assert not any(s["initialized"] for s in seen), seen


def test_array_task_is_requeued_as_array_underscore_task(
    requeues: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = requeues
    assert [result["array"]["code"] for result in results] == [0, 0], results
    assert _calls(root, "array") == ["requeue 70_3"]


def test_requeue_cap_reached_exits_75_without_calling_scontrol(
    requeues: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = requeues
    seen = [result["cap"] for result in results]
    assert [s["code"] for s in seen] == [75, 75], seen
    assert "cap reached" in seen[0]["stderr"], seen
    assert _calls(root, "cap") is None


def test_failing_scontrol_exits_75_on_every_rank_quoting_its_output(
    requeues: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = requeues
    seen = [result["fails"] for result in results]
    assert [s["code"] for s in seen] == [75, 75], seen
    assert _calls(root, "fails") == ["requeue 77"]
    message = seen[0]["stderr"]
    asked = "asking SLURM to put the job back"
    failed = "scontrol requeue 77 failed with exit code 1"
    assert asked in message and failed in message, message
    assert message.index(asked) < message.index(failed), message
    assert "Invalid job id specified for 77" in message, message


def test_under_torchs_agent_the_main_rank_waits_for_its_output_to_be_copied_before_a_requeue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent copies a worker's log file every 0.1 s; the requeue cuts the step's output."""
    slept: list[float] = []
    monkeypatch.setattr(preempt.time, "sleep", slept.append)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    preempt._let_the_launcher_copy_output()
    assert slept == []  # srun started the worker: it writes to the step's output itself
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "13")
    preempt._let_the_launcher_copy_output()
    assert slept == [preempt.COPY_GRACE_S]


# ---------------------------------------------------------------------------------- errors


@pytest.fixture
def usr2_handler_kept() -> Any:
    before = signal.getsignal(signal.SIGUSR2)
    yield
    signal.signal(signal.SIGUSR2, before)
    stopsignal.clear(signal.SIGUSR2)


@pytest.mark.usefixtures("usr2_handler_kept")
def test_guard_before_init_is_a_usage_error() -> None:
    assert current_or_none() is None
    before = signal.getsignal(signal.SIGUSR2)
    with pytest.raises(UsageError, match=r"init\(\)"):
        ddpkit.preemption_guard(env={})
    assert signal.getsignal(signal.SIGUSR2) is before  # nothing installed


@pytest.mark.usefixtures("usr2_handler_kept")
@pytest.mark.parametrize("every", [0, -1, True, 1.5])
def test_check_every_below_one_is_a_config_error(every: Any) -> None:
    with pytest.raises(ConfigError, match=rf"check_every={every!r}"):
        ddpkit.preemption_guard(check_every=every, env={})


@pytest.mark.usefixtures("usr2_handler_kept")
def test_bad_signal_or_cap_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="DDPKIT_SIGNAL='KILL'"):
        ddpkit.preemption_guard(env={"DDPKIT_SIGNAL": "KILL"})
    with pytest.raises(ConfigError, match="signal_name='KILL'"):
        ddpkit.preemption_guard("KILL", env={})
    with pytest.raises(ConfigError, match="DDPKIT_MAX_REQUEUES"):
        ddpkit.preemption_guard(env={"DDPKIT_MAX_REQUEUES": "many"})


def _early_signal_worker(rank: int, world_size: int, port: int, variable: str) -> bool:
    env = torchrun_env(rank, world_size, port)
    if variable:
        env["DDPKIT_SIGNAL"] = variable
    ddpkit.init(backend="gloo", env=env)  # latches DDPKIT_SIGNAL before anything else
    try:
        os.kill(os.getpid(), signal.SIGUSR2)  # before the guard exists: must not end the process
        time.sleep(0.1)
        return ddpkit.preemption_guard(env=env).should_stop()
    finally:
        ddpkit.shutdown()


def test_init_latches_the_job_signal_so_an_early_one_is_not_lost() -> None:
    assert run_workers(_early_signal_worker, 1, "USR2", timeout_s=60) == [True]


def test_without_the_job_variable_init_leaves_the_signal_alone() -> None:
    # no DDPKIT_SIGNAL: USR2 keeps its default action and ends the worker
    killed = rf"died without a result: {{0: -{int(signal.SIGUSR2)}}}"  # killed by the signal
    with pytest.raises(AssertionError, match=killed):
        run_workers(_early_signal_worker, 1, "", timeout_s=60)
