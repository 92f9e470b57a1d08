"""``ddpkit run`` end to end: real workers started by torch's elastic agent, gloo on 127.0.0.1.

Launches cost seconds on a small machine, so each test checks everything one launch can show.
The worker scripts live in tests/scripts/ (worker.py imports torch; env_worker.py does not).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.run as torch_run

from ddpkit.cli import main
from ddpkit.cli.run import config_from_argv
from ddpkit.errors import ConfigError
from ddpkit.launch.local import build_launch_config

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests/scripts/worker.py"
ENV_WORKER = "tests/scripts/env_worker.py"
PREFIX = re.compile(r"^\[rank(\d)\]: (.*)$")

pytestmark = pytest.mark.multiproc


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    for name in list(os.environ):
        if name.startswith("PET_") or name == "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE":
            monkeypatch.delenv(name)
    for name in ("DDPKIT_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID"):  # the run id's sources
        monkeypatch.delenv(name, raising=False)


def by_rank(text: str) -> dict[int, list[str]]:
    """Worker lines grouped by the rank in their prefix (lines without one are skipped)."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        match = PREFIX.match(line)
        if match:
            lines.setdefault(int(match.group(1)), []).append(match.group(2))
    return lines


def summary(err: str) -> str:
    """ddpkit's root-cause report: everything from its first line on."""
    start = err.find("ddpkit: worker failed")
    assert start >= 0, err
    return err[start:]


# --- LaunchConfig built by torch's own parser ---------------------------------------------------


def test_launch_config_matches_torchrun_for_a_static_multi_node_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # else torch's config_from_args writes it
    argv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "node1", "--nproc-per-node", "2"]
    argv += ["--max-restarts", "3", "--rdzv-conf", "join_timeout=60", "-t", "2", WORKER, "--x"]
    plan = build_launch_config(config_from_argv(argv))
    theirs, cmd, cmd_args = torch_run.config_from_args(torch_run.parse_args(argv))
    ours = plan.launch_config
    assert ours.rdzv_endpoint == "node1:29500" and ours.rdzv_backend == "static"
    for name in ("min_nodes", "max_nodes", "nproc_per_node", "run_id", "role", "rdzv_configs"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for name in ("max_restarts", "monitor_interval", "start_method", "local_addr"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert (
        repr(ours.logs_specs).split("root_log_dir")[0]
        == repr(theirs.logs_specs).split("root_log_dir")[0]
    )
    assert (plan.entrypoint, list(plan.args)) == (cmd, cmd_args)
    assert ours.log_line_prefix_template == "[rank${rank}]: "
    assert theirs.log_line_prefix_template is None
    assert plan.worker_env == {}


def test_standalone_is_c10d_on_a_free_port_and_omp_goes_to_workers_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    first = build_launch_config(config_from_argv(["--nproc-per-node", "2", WORKER]))
    second = build_launch_config(config_from_argv(["--nproc-per-node", "2", WORKER]))
    config = first.launch_config
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "localhost:0")
    assert config.run_id != second.launch_config.run_id
    assert "OMP_NUM_THREADS" not in os.environ
    # one run id per launch for its workers: the rendezvous id, fresh per standalone launch
    assert first.worker_env == {"OMP_NUM_THREADS": "1", "DDPKIT_RUN_ID": config.run_id}
    assert second.worker_env["DDPKIT_RUN_ID"] == second.launch_config.run_id != config.run_id
    assert "redirects=0, tee=3," in repr(config.logs_specs)


@pytest.mark.parametrize(
    ("node", "conf", "is_host"),
    [
        ("n1", [], "1"),  # the job's first node hosts the store, explicitly
        ("n2", [], "0"),
        ("n2", ["--rdzv-conf", "is_host=1,join_timeout=60"], "1"),  # the user's setting wins
        (None, [], None),  # not in a SLURM job step: torch guesses
    ],
)
def test_c10d_store_host_in_a_slurm_job_with_a_host_template(
    monkeypatch: pytest.MonkeyPatch, node: str | None, conf: list[str], is_host: str | None
) -> None:
    # the endpoint the generated torchrun job script passes: its first node, host template on
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "DDPKIT_HOST_TEMPLATE": "{host}-ib"}
    env |= {} if node is None else {"SLURMD_NODENAME": node}
    for name in ("SLURMD_NODENAME", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1-ib:29400", *conf]
    plan = build_launch_config(config_from_argv([*argv, WORKER]))
    assert plan.launch_config.rdzv_configs.get("is_host") == is_host
    assert (plan.launch_config.rdzv_configs.get("join_timeout") == "60") == bool(conf)


C10D = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--nproc-per-node", "2"], 61),  # standalone: 60 s + 10 ms a rank after the first
        (["--nnodes", "1:512", "--nproc-per-node", "8", *C10D], 101),  # 4,096 ranks at most
        (["--nnodes", "512", "--nproc-per-node", "8", *C10D, "--rdzv-conf", "read_timeout=30"],
         "30"),  # the user's value, as given
        (["--nnodes", "2", "--master-addr", "n1", "--nproc-per-node", "2"], None),  # static
    ],
)  # fmt: skip
def test_c10d_read_timeout_grows_with_the_job_unless_given(
    argv: list[str], expected: int | str | None
) -> None:
    plan = build_launch_config(config_from_argv([*argv, WORKER]))
    assert plan.launch_config.rdzv_configs.get("read_timeout") == expected


def test_device_kind_this_machine_lacks_is_a_config_error() -> None:
    config = config_from_argv(["--nproc-per-node", "gpu", WORKER])
    if torch.cuda.is_available():
        count = build_launch_config(config).launch_config.nproc_per_node
        assert count == torch.cuda.device_count()
    else:
        with pytest.raises(ConfigError, match=r"--nproc-per-node='gpu'.*Cuda is not available"):
            build_launch_config(config)


# --- launches ------------------------------------------------------------------------------------


def test_two_concurrent_runs_one_all_reducing_in_order_one_failing_from_its_error_file(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """One run through ``python -m ddpkit`` and, at the same time, one in this process: each
    group forms on its own port. The in-process one all-reduces, its output prefixed and in
    order; in the other, rank 0 raises once its group has formed, under torch's ``record``: its
    root cause comes from the error file it wrote. (One launch of torch workers for both.)"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc_per_node=2", WORKER]
    other = subprocess.Popen(
        [*command, "--fail-rank", "0", "--record"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        handler_before = signal.getsignal(signal.SIGTERM)
        script_args = ["--lines", "15", "pos", "--opt=1", "-x"]
        assert main(["run", "--nproc-per-node", "2", WORKER, *script_args]) == 0
        other_out, other_err = other.communicate(timeout=120)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert other.returncode == 1, other_out + other_err
    out, err = capfd.readouterr()
    assert signal.getsignal(signal.SIGTERM) is handler_before  # torch's handler was removed
    assert all(PREFIX.match(line) for line in out.splitlines() if line), out
    stdout, stderr = by_rank(out), by_rank(err)
    for rank in (0, 1):
        lines = stdout[rank]
        env_line = f"env RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2"
        assert lines[0].startswith(env_line), lines
        assert json.loads(lines[1].removeprefix("args ")) == script_args
        assert [line for line in lines if line.startswith("line")] == [
            f"line {rank} {i}" for i in range(15)
        ]
        assert lines[-1] == "sum 3"  # 1 + 2
        assert [line for line in stderr[rank] if line.startswith("eline")] == [
            f"eline {rank} {i}" for i in range(15)
        ]
    # the other run: both ranks started on one port; rank 0 raises only after
    # init_process_group returned, that is once its group had formed
    other_lines = by_rank(other_out)
    assert sorted(other_lines) == [0, 1], other_out
    report = summary(other_err)
    assert report.startswith("ddpkit: worker failed (root cause): rank 0 (local rank 0)"), report
    assert "error.json" in report.splitlines()[1], report  # from the file torch's record wrote
    assert "  ValueError: boom from rank 0" in report.splitlines(), report
    ports = {re.findall(r"MASTER_PORT=(\d+)", text)[0] for text in (out, other_out)}
    assert len(ports) == 2, (out, other_out)


PIECES = """
import os, sys, time
rank = os.environ["RANK"]
for i in range(8):
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"piece {rank} {i} a")  # as print under PYTHONUNBUFFERED=1: text, then
        stream.flush()  # its newline, in a second write
        time.sleep(0.04)  # 4 polls of the tee between them
        stream.write(" b\\n")
        stream.flush()
"""


def test_a_line_written_in_pieces_is_printed_as_one_line(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "pieces.py"
    script.write_text(PIECES)
    assert main(["run", "--nproc-per-node", "2", str(script)]) == 0
    out, err = capfd.readouterr()
    for text in (out, err):
        lines = by_rank(text)
        for rank in (0, 1):
            pieces = [line for line in lines[rank] if line.startswith("piece")]
            assert pieces == [f"piece {rank} {i} a b" for i in range(8)], text
    assert all(PREFIX.match(line) for line in out.splitlines() if line), out


@pytest.mark.parametrize(
    ("argv", "bind"),
    [
        ([], "127.0.0.1"),  # --standalone: c10d on localhost:0, one node, one round
        (["--rdzv-endpoint", "127.0.0.1:29411", "--rdzv-backend", "c10d"], "127.0.0.1"),
        (["--max-restarts", "1"], None),  # a fresh store each round: keys of a round before
        (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29411", "--rdzv-backend", "c10d"], None),
        (["--rdzv-endpoint", "192.0.2.1:29411", "--rdzv-backend", "c10d"], None),  # not loopback
        (["--local-addr", "192.0.2.1"], None),  # the user named this node's address
    ],
)
def test_the_workers_share_the_agents_store_only_in_a_one_node_run_of_one_round(
    argv: list[str], bind: str | None
) -> None:
    plan = build_launch_config(config_from_argv(["--nproc-per-node", "2", *argv, WORKER]))
    assert plan.shared_store_bind == bind
    if bind is not None:  # the workers' MASTER_ADDR is where that store listens
        assert plan.launch_config.local_addr == bind


_STORE_REPORT = """
import os
print(os.environ["RANK"], os.environ["MASTER_ADDR"], os.environ["TORCHELASTIC_USE_AGENT_STORE"])
"""


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], "127.0.0.1 True"), (["--max-restarts", "1"], "localhost False")],
    ids=["one-round", "restarts"],
)
def test_a_one_round_run_hands_its_workers_the_agents_store(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    flags: list[str],
    expected: str,
) -> None:
    script = tmp_path / "store.py"
    script.write_text(_STORE_REPORT)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--nproc-per-node", "2", *flags, str(script)]) == 0
    out, err = capfd.readouterr()
    seen = sorted(line.split("]: ", 1)[-1] for line in out.splitlines() if "]: " in line)
    assert seen == [f"0 {expected}", f"1 {expected}"], out + err


def test_module_flag_runs_python_m(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    scripts = str(ROOT / "tests" / "scripts")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([scripts, os.environ.get("PYTHONPATH", "")]))
    assert main(["run", "--nproc-per-node", "2", "-m", "env_worker", "a", "-b"]) == 0
    lines = by_rank(capfd.readouterr().out)
    for rank in (0, 1):
        assert lines[rank][0].startswith(f"env RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2")
        assert json.loads(lines[rank][1].removeprefix("args ")) == ["a", "-b"]


def test_no_python_runs_a_command(capfd: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--nproc-per-node", "2", "--no-python", sys.executable, ENV_WORKER, "z"]
    assert main(argv) == 0
    lines = by_rank(capfd.readouterr().out)
    assert sorted(lines) == [0, 1]
    assert all(json.loads(lines[r][1].removeprefix("args ")) == ["z"] for r in (0, 1))


def test_run_path_runs_the_script_inside_spawned_interpreters(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["run", "--nproc-per-node", "2", "--run-path", ENV_WORKER]
    # rank 1 fails once rank 0 has printed (the agent then ends rank 0: seen in CI before its
    # first line, when its interpreter started later than rank 1's)
    script_args = ["--exit-rank", "1", "--code", "4", "--await-dir", str(tmp_path)]
    assert main([*argv, *script_args]) == 4
    out, err = capfd.readouterr()
    lines = by_rank(out)
    for rank in (0, 1):
        assert json.loads(lines[rank][1].removeprefix("args ")) == script_args, out
    assert (
        summary(err)
        .splitlines()[0]
        .endswith("rank 1 (local rank 1) on " + socket.gethostname() + ": exit code 4")
    )


def test_worker_exit_code_without_traceback_is_passed_on_after_restarts(
    capfd: pytest.CaptureFixture[str],
) -> None:
    argv = ["run", "--nproc-per-node", "2", "--max-restarts", "1", ENV_WORKER]
    assert main([*argv, "--exit-rank", "1", "--code", "3"]) == 3
    out, err = capfd.readouterr()
    restarts = [line.split("RESTART_COUNT=")[1] for line in by_rank(out)[1] if "env" in line]
    assert restarts == ["0", "1"]  # one restart, then the launch gives up
    report = summary(err)
    assert "rank 1 (local rank 1)" in report and report.splitlines()[0].endswith("exit code 3")
    assert "no traceback: the worker exited without raising" in report
    assert re.search(r"attempt_1/1/stderr\.log\)", report), report  # the last attempt's log


def test_a_script_that_does_not_compile_is_reported_with_pythons_report(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Python prints no traceback header for a script with a syntax error: its file, line and
    the error are the report, not "exited without raising"."""
    script = tmp_path / "broken.py"
    script.write_text("import os\nx = (\n")
    assert main(["run", "--nproc-per-node", "1", "--log-dir", str(tmp_path), str(script)]) == 1
    report = summary(capfd.readouterr().err)
    assert "exited without raising" not in report, report
    lines = report.splitlines()
    assert lines[1].startswith("ddpkit: traceback of rank 0 (from "), report
    stripped = [line.strip() for line in lines]
    assert f'File "{script}", line 2' in stripped, report
    assert "SyntaxError: '(' was never closed" in stripped, report


def test_failing_rank_reports_root_cause_with_traceback(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["run", "--nproc-per-node", "2", "--log-dir", str(tmp_path), WORKER]
    assert main([*argv, "--fail-rank", "1"]) == 1
    err = capfd.readouterr().err
    report = summary(err)
    first = report.splitlines()[0]
    assert first.startswith("ddpkit: worker failed (root cause): rank 1 (local rank 1) on ")
    assert first.endswith(": exit code 1")
    log = re.escape(str(tmp_path)) + r"/[^/]+_[^/]+/attempt_0/1/stderr\.log"
    assert re.fullmatch(rf"ddpkit: traceback of rank 1 \(from {log}\):", report.splitlines()[1])
    assert "  ValueError: boom from rank 1" in report.splitlines()
    assert "[rank1]" not in report  # the prefixes of the log were stripped
    # the tee'd traceback: torch's excepthook prefix and the launcher's, once
    console = err[: err.find("ddpkit: worker failed")].splitlines()
    assert "[rank1]: Traceback (most recent call last):" in console, err
    assert not [line for line in console if line.startswith("[rank1]: [rank1]")], err
    assert "ChildFailedError" not in err and "Root Cause" not in err  # no torch box
    assert "ddpkit: worker logs: " in report


@pytest.mark.parametrize(
    ("how", "sig"),
    [
        ("abort", signal.SIGABRT),
        ("segv", signal.SIGSEGV),
        ("SIGBUS", signal.SIGBUS),
        ("SIGKILL", signal.SIGKILL),
        ("SIGTERM", signal.SIGTERM),
    ],
)
def test_a_worker_killed_by_a_signal_is_reported_with_that_signal_and_its_stderr(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, how: str, sig: signal.Signals
) -> None:
    argv = ["run", "--nproc-per-node", "2", "--log-dir", str(tmp_path), ENV_WORKER]
    assert main([*argv, "--die-rank", "1", "--die", how]) == 128 + sig
    report = summary(capfd.readouterr().err)
    lines = report.splitlines()
    assert f"rank 1 (local rank 1) on {socket.gethostname()}: signal {sig.name}" in lines[0]
    assert f"(exit code {128 + sig})" in lines[0]
    assert "ddpkit: traceback of rank" not in report  # the handled one it logged is no cause
    why = next(line for line in lines if line.startswith("ddpkit: no traceback"))
    assert f"died of {sig.name}" in why, report
    # only SIGKILL may be the OOM killer, and then only as a possibility
    assert ("OOM" in report) == (sig == signal.SIGKILL), report
    assert "out of memory" not in report.lower() or "possibly the OOM killer" in report
    (log,) = tmp_path.glob("*/attempt_0/1/stderr.log")
    assert f"rank 1 dies by {how}" in log.read_text()
    assert f"ddpkit: last lines of its stderr ({log}):" in lines, report
    assert f"  rank 1 dies by {how}" in lines, report


def test_a_killed_worker_whose_stderr_went_to_the_console_only_says_so(
    capfd: pytest.CaptureFixture[str],
) -> None:
    argv = ["run", "--nproc-per-node", "2", "--tee", "1", ENV_WORKER]
    assert main([*argv, "--die-rank", "0", "--die", "abort"]) == 128 + signal.SIGABRT
    report = summary(capfd.readouterr().err)
    assert "died of SIGABRT" in report
    assert "its stderr went to the console only" in report, report


@pytest.mark.parametrize(
    ("how", "sig"),
    [("abort", signal.SIGABRT), ("segv", signal.SIGSEGV), ("SIGKILL", signal.SIGKILL)],
)
def test_a_signal_reported_by_a_wrapper_shell_is_named(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, how: str, sig: signal.Signals
) -> None:
    """``--no-python sh -c "python train.py; ..."``: the shell outlives the training process and
    exits 128 + N for its signal N. Before: "exit code 139" and the handled traceback the
    process had logged earlier, as if it were the cause; the signal was never named."""
    wrapped = f'"{sys.executable}" {ENV_WORKER} --die-rank 1 --die {how}; exit $?'
    argv = ["run", "--nproc-per-node", "2", "--log-dir", str(tmp_path), "--no-python"]
    assert main([*argv, "sh", "-c", wrapped]) == 128 + sig
    report = summary(capfd.readouterr().err)
    lines = report.splitlines()
    assert f"rank 1 (local rank 1) on {socket.gethostname()}: exit code {128 + sig}" in lines[0]
    assert f"128 + {int(sig)}: {sig.name}" in lines[0], report
    assert "ddpkit: traceback of rank" not in report  # the handled one is no cause
    why = next(line for line in lines if line.startswith("ddpkit: no traceback"))
    assert f"died of {sig.name}" in why, report
    assert ("OOM" in report) == (sig == signal.SIGKILL), report
    (log,) = tmp_path.glob("*/attempt_0/1/stderr.log")
    assert f"ddpkit: last lines of its stderr ({log}):" in lines, report
    assert f"  rank 1 dies by {how}" in lines, report


def test_an_exit_code_above_128_that_is_no_signal_is_left_alone(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """255 (``exit(-1)``) is no 128 + a signal: reported as the code it is."""
    argv = ["run", "--nproc-per-node", "2", ENV_WORKER, "--exit-rank", "0", "--code", "255"]
    assert main(argv) == 255
    report = summary(capfd.readouterr().err)
    assert report.splitlines()[0].endswith(
        "rank 0 (local rank 0) on " + socket.gethostname() + ": exit code 255"
    ), report


@pytest.mark.parametrize("order", ["rank0-first", "rank1-first"])
def test_a_sigterm_root_cause_beats_a_peer_sigtermed_while_it_started(
    tmp_path: Path, order: str
) -> None:
    """Rank 1 died of SIGTERM (sent by someone else) after writing to its log; the agent's
    shutdown then SIGTERMed rank 0, still starting, its log empty (created at the attempt's
    start, before rank 1 wrote). Before: rank 0 was named, by its empty log's mtime (flaky
    under load, when rank 0 starts slowly)."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddpkit.launch.report import failed_outcome

    quiet, noisy = tmp_path / "0.log", tmp_path / "1.log"
    quiet.write_text("")
    os.utime(quiet, (1000.0, 1000.0))  # the attempt's start
    noisy.write_text("rank 1 dies by SIGTERM\n")
    os.utime(noisy, (1000.4, 1000.4))
    failures = {
        0: ProcessFailure(0, 4000, -signal.SIGTERM, ""),
        1: ProcessFailure(1, 4001, -signal.SIGTERM, ""),
    }
    for failure in failures.values():
        failure.timestamp = 1000  # torch's whole second, the same for both
    if order == "rank1-first":
        failures = dict(reversed(failures.items()))
    logs = LogsDest(stderrs={0: str(quiet), 1: str(noisy)})
    outcome = failed_outcome(ChildFailedError("train.py", failures), logs)
    assert outcome.root_cause.rank == 1


def test_local_ranks_filter_keeps_the_other_ranks_off_the_console_not_out_of_their_logs(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # torch's own filter (a spec's log_ranks renders it): 1,000 ranks need not print 1,000 copies
    argv = ["run", "--nproc-per-node", "2", "--local-ranks-filter", "1", "--log-dir", str(tmp_path)]
    assert main([*argv, ENV_WORKER]) == 0
    shown = by_rank(capfd.readouterr().out)
    assert list(shown) == [1] and any("RANK=1" in line for line in shown[1]), shown
    (log,) = tmp_path.glob("*/attempt_0/0/stdout.log")
    assert "RANK=0" in log.read_text()  # rank 0 still wrote its own log file


def test_the_prefix_template_may_name_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "node7.cluster.example")
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${host} rank${rank}]: "}
    plan = build_launch_config(config_from_argv(["--nproc-per-node", "1", WORKER], env))
    # ${rank} is torch's to fill in per worker; ${host} ddpkit's, once per launch
    assert plan.launch_config.log_line_prefix_template == "[node7 rank${rank}]: "
    plain = build_launch_config(config_from_argv(["--nproc-per-node", "1", WORKER], {}))
    assert plain.launch_config.log_line_prefix_template == "[rank${rank}]: "
