"""Numbers are ASCII digits: ``²``, ``３`` or ``٣`` in a flag or a variable is the one-line error.

``str.isdigit()`` takes ``"²"`` (which ``int()`` then rejects with a traceback) and ``int()``
reads ``"３"`` and ``"٣"`` as 3 without a word. Each numeric flag of ``ddpkit run`` and its
``PET_`` variable, and each numeric variable ddpkit reads, must refuse all three the same way:
exit 2 (or, for the worker's variables, a ``ConfigError``), one line naming the flag or
variable and the value, a hint saying that only 0-9 are read, no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cli import main
from ddpkit.cluster.durations import seconds_from_env
from ddpkit.cluster.rendezvous.ports import reserved_port
from ddpkit.cluster.stop.requeue import max_requeues_from, plan_requeue
from ddpkit.cluster.stop.signals import parse_signal
from ddpkit.errors import ConfigError
from ddpkit.worker.watchdog.policy import peer_timeout

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/scripts/env_worker.py"
# superscript two, full-width three, Arabic-Indic three
FOREIGN = ["²", "３", "٣"]
NOTE = "only the ASCII digits 0-9 are read"


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)


# flag -> how a digit is put into its value (every other part of the value is valid)
FLAGS: dict[str, Callable[[str], str]] = {
    "--nproc-per-node": lambda d: d,
    "--master-port": lambda d: f"2950{d}",
    "--nnodes": lambda d: d,
    "--nnodes ": lambda d: f"1:{d}",  # MIN:MAX (the trailing blank only keeps the key unique)
    "--node-rank": lambda d: d,
    "--max-restarts": lambda d: d,
    "--monitor-interval": lambda d: f"0.{d}",
    "--local-ranks-filter": lambda d: f"0,{d}",
    "--rdzv-endpoint": lambda d: f"node1:2940{d}",
    "--redirects": lambda d: f"{d}:1",
    "--tee": lambda d: d,
    "--rdzv-conf": lambda d: f"join_timeout={d}00",
}
CASES = [(flag, digit) for flag in FLAGS for digit in FOREIGN]


def _expect_one_line(code: int, out: str, err: str, named: str) -> None:
    """Exit 2, nothing on stdout, one line on stderr naming ``named`` (``NAME='value'``)."""
    assert code == 2, (code, err)
    assert out == "" and "Traceback" not in err, err
    assert err.startswith("ddpkit: error: ") and err.count("\n") == 1, err
    assert named in err and NOTE in err, err


def _named(name: str, value: str) -> str:
    """How the error quotes a value: ``--rdzv-conf`` names the key inside it."""
    if name in ("--rdzv-conf", "PET_RDZV_CONF"):
        key, _, inner = value.partition("=")
        return f"{key}={inner!r}"
    return f"{name}={value!r}"


@pytest.mark.parametrize(("flag", "digit"), CASES)
def test_a_foreign_digit_in_a_flag_is_the_one_line_error(
    capsys: pytest.CaptureFixture[str], flag: str, digit: str
) -> None:
    value = FLAGS[flag](digit)
    extra = ["--nnodes", "2"] if flag == "--node-rank" else []
    code = main(["run", "--dry-run", *extra, flag.strip(), value, SCRIPT])
    out, err = capsys.readouterr()
    _expect_one_line(code, out, err, _named(flag.strip(), value))


@pytest.mark.parametrize(("flag", "digit"), CASES)
def test_a_foreign_digit_in_a_pet_variable_is_the_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: str, digit: str
) -> None:
    variable = "PET_" + flag.strip().removeprefix("--").replace("-", "_").upper()
    value = FLAGS[flag](digit)
    monkeypatch.setenv(variable, value)
    code = main(["run", "--dry-run", SCRIPT])
    out, err = capsys.readouterr()
    _expect_one_line(code, out, err, _named(variable, value))


@pytest.mark.parametrize("flag", list(FLAGS))
def test_through_the_ddpkit_command_no_traceback(flag: str) -> None:
    """The whole process, entry point included, with the value that made a traceback."""
    value = FLAGS[flag]("²")
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", "--dry-run", flag.strip(), value, SCRIPT],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    _expect_one_line(done.returncode, done.stdout, done.stderr, _named(flag.strip(), value))


def test_a_foreign_digit_in_ddpkit_signal_stops_ddpkit_run_with_the_one_line_error() -> None:
    """The real launcher, once (it imports torch first: ~2.5 CPU-s); each foreign digit in
    DDPKIT_SIGNAL is refused in-process by the worker-variable test below."""
    value = "1²"  # the one int() raises on: a traceback before
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "DDPKIT_SIGNAL": value}
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", SCRIPT],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    _expect_one_line(done.returncode, done.stdout, done.stderr, f"DDPKIT_SIGNAL={value!r}")


# The variables of a launcher's environment, as `ddpkit env` reports its detection.
TORCHRUN = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "x",
}
SLURM = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_NNODES": "1",
    "SLURM_JOB_NODELIST": "n1",
    "SLURM_STEP_NODELIST": "n1",
    "SLURMD_NODENAME": "n1",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2",
}
DETECTED = [
    *((TORCHRUN, name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")),
    *((SLURM, name) for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS")),
]


@pytest.mark.parametrize(("base", "name"), DETECTED, ids=[name for _, name in DETECTED])
def test_a_foreign_digit_in_a_launcher_variable_is_reported_by_ddpkit_env(
    base: dict[str, str], name: str
) -> None:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM", "RANK", "WORLD_", "LOCAL_", "MASTER_", "TORCHELASTIC"))
        and not k.startswith(("GROUP_", "OMPI_", "PMI_", "DDPKIT_", "SUBMITIT_"))
    }
    env = {**clean, **base, name: "３", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "env", "--json", "--no-torch"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    error = str(json.loads(done.stdout)["launcher"].get("error", ""))
    assert f"{name}='３' is not an integer" in error and NOTE in error, error
    assert "\n" not in error


# The variables read inside a worker (no command of their own): the ConfigError, one line.
WORKER_READS: dict[str, Callable[[dict[str, str]], Any]] = {
    "DDPKIT_CONNECT_TIMEOUT": lambda env: seconds_from_env(
        env, "DDPKIT_CONNECT_TIMEOUT", example="120"
    ),
    "DDPKIT_COLLECTIVE_TIMEOUT": lambda env: seconds_from_env(
        env, "DDPKIT_COLLECTIVE_TIMEOUT", example="1800"
    ),
    "DDPKIT_PEER_TIMEOUT": lambda env: peer_timeout(env, None),
    "DDPKIT_MAX_REQUEUES": lambda env: max_requeues_from(None, env),
    "DDPKIT_SIGNAL": lambda env: parse_signal(env["DDPKIT_SIGNAL"]),
    "SLURM_STEP_RESV_PORTS": reserved_port,
}


@pytest.mark.parametrize(("name", "digit"), [(n, d) for n in WORKER_READS for d in FOREIGN])
def test_a_foreign_digit_in_a_worker_variable_is_a_one_line_config_error(
    name: str, digit: str
) -> None:
    value = f"1{digit}"
    with pytest.raises(ConfigError) as caught:
        WORKER_READS[name]({name: value})
    message = str(caught.value)
    assert f"{name}={value!r}" in message and NOTE in message and "\n" not in message


def test_a_zero_in_another_script_does_not_turn_the_watchdog_off() -> None:
    with pytest.raises(ConfigError, match="DDPKIT_PEER_TIMEOUT='０'"):
        peer_timeout({"DDPKIT_PEER_TIMEOUT": "０"}, None)
    assert peer_timeout({"DDPKIT_PEER_TIMEOUT": "0"}, None) is None


def test_an_unreadable_restart_count_counts_as_zero_not_as_a_traceback() -> None:
    """SLURM's own counter: as before, what is not a count reads as 0 (now ASCII only)."""
    env = {"SLURM_JOB_ID": "7"}
    assert plan_requeue({**env, "SLURM_RESTART_COUNT": "²"}, 10).restarts == 0
    assert plan_requeue({**env, "SLURM_RESTART_COUNT": "３"}, 10).restarts == 0
    assert plan_requeue({**env, "SLURM_RESTART_COUNT": "3"}, 10).restarts == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        *[("7", 7), ("-2", -2), ("0", 0), ("²", None), ("３", None), ("٣", None)],
        *[("1_0", None), (" 7", None), ("7\n", None), ("", None), ("+7", None), ("7.0", None)],
    ],
)
def test_to_int_reads_ascii_digits_only(text: str, expected: int | None) -> None:
    from ddpkit.cluster.envvars import to_int

    assert to_int(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        *[("1", 1.0), ("0.5", 0.5), (".5", 0.5), ("1e-3", 0.001), ("-2", -2.0), ("３", None)],
        *[("0.５", None), ("inf", None), ("nan", None), ("1_0", None), ("", None), ("1e", None)],
    ],
)
def test_to_float_reads_plain_ascii_decimals_only(text: str, expected: float | None) -> None:
    from ddpkit.cluster.envvars import to_float

    assert to_float(text) == expected


# The job commands and doctor: a count, a rank or a job id in another script's digits.
JOB_COMMANDS: dict[str, tuple[Callable[[str], list[str]], Callable[[str], str]]] = {
    "doctor --world-size": (
        lambda d: ["doctor", "--no-comm", "--world-size", d],
        lambda d: f"--world-size={d!r}",
    ),
    "logs --rank": (lambda d: ["logs", "--rank", d, "123"], lambda d: f"--rank={d!r}"),
    "status": (lambda d: ["status", f"12{d}"], lambda d: f"job_id='12{d}'"),
    "cancel": (lambda d: ["cancel", f"12{d}_0"], lambda d: f"job_id='12{d}_0'"),
    "logs": (lambda d: ["logs", f"123_{d}"], lambda d: f"job_id='123_{d}'"),
}


@pytest.mark.parametrize(("command", "digit"), [(c, d) for c in JOB_COMMANDS for d in FOREIGN])
def test_a_foreign_digit_in_a_job_command_is_the_one_line_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    digit: str,
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM tool: nothing may be asked
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    argv, named = JOB_COMMANDS[command]
    code = main(argv(digit))
    out, err = capsys.readouterr()
    _expect_one_line(code, out, err, named(digit))
