"""The per-node health check (``python -m ddpkit.cluster.stop.health``): a real bash runs the
check; its verdict, its output in the log, its bound, and the stop signal kept away from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.cluster.stop.health import check_node, node_name, report_line


def test_a_passing_check_says_nothing_against_the_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_node("echo fine; true", 10, node="n1") is None
    assert capsys.readouterr().err == "ddpkit health check [n1]: fine\n"


def test_a_failing_check_gives_its_exit_code_and_last_line() -> None:
    why = check_node("echo one; echo 'two \x1b[31m red'; echo; exit 3", 10, node="n1")
    assert why == "exit code 3: two ?[31m red"  # control characters do not reach the log line


def test_a_long_last_line_is_shortened() -> None:
    why = check_node("printf 'x%.0s' $(seq 500); exit 1", 10, node="n1")
    assert why is not None and len(why) == len("exit code 1: ") + 200 and why.endswith("...")


def test_a_check_killed_by_a_signal_says_which() -> None:
    assert check_node("echo dying; kill -KILL $$", 10, node="n1") == "killed by SIGKILL: dying"


def test_a_check_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    check = f"sleep 60 & echo $! > {pid_file}; wait"
    assert check_node(check, 0.5, node="n1") == "timed out after 0.5 s"
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the check's child outlived the timeout"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_the_node_is_slurms_name_for_it() -> None:
    assert node_name({"SLURMD_NODENAME": "n3"}) == "n3"
    assert node_name({}) == os.uname().nodename


def test_the_module_reports_one_json_line_and_holds_the_stop_signal(tmp_path: Path) -> None:
    # the check sends itself the stop signal: blocked, it stays pending and fails nothing
    env = {**os.environ, "SLURMD_NODENAME": "n2", "DDPKIT_SIGNAL": "USR2"}
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit.cluster.stop.health", "--timeout-s", "20", "--",
         "kill -USR2 $$; kill -USR2 $PPID; echo survived"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"ddpkit_health": 1, "node": "n2", "ok": True, "why": None}
    assert done.stdout == report_line("n2", None) + "\n"
    assert "ddpkit health check [n2]: survived" in done.stderr


def test_the_module_reports_a_failure_and_still_exits_0() -> None:
    env = {**os.environ, "SLURMD_NODENAME": "n2"}
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit.cluster.stop.health", "--timeout-s", "20", "--",
         "echo 'no \"GPU\"'; exit 1"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["why"] == 'exit code 1: no "GPU"'


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_a_bad_timeout_is_refused(timeout: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit.cluster.stop.health", "--timeout-s", timeout, "--", "true"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--timeout-s" in done.stderr
    assert done.stdout == ""
