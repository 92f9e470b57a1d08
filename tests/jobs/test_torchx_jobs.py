"""``ddpkit submit --via torchx`` and status/logs/cancel of what it printed.

In-process CLI for dry runs and bad input (nothing may be written), a subprocess without torchx
for the missing extra, and a real local_cwd run (1 node x 2 processes, this machine). The real
SLURM runs are tests/jobs/test_torchx_jobs_cluster.py. Payload: tests/scripts/report_rank_env.py
(torch-free: what a submission, its record, status and logs show is where each rank landed; the
group's forming under torchx's local scheduler is tests/test_components.py's runner test).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cli import main
from ddpkit.cluster.slurmtools import JobState
from ddpkit.errors import ConfigError
from ddpkit.jobs.backends.torchx import TORCHX_STATES, state_from_torchx
from ddpkit.jobs.records import JobRecord, load_record, record_key, record_path, save_record

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = ROOT / "tests" / "scripts" / "report_rank_env.py"


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_spec(directory: Path, fields: str, args: str = "", payload: Path = PAYLOAD) -> Path:
    path = directory / "job.yaml"
    path.write_text(f"name: demo\ncommand: {payload} {args}\ntime_min: 5\n{fields}")
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def reports(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[line.index("{") :]) for line in text.splitlines() if '{"rank"' in line]


def test_state_table_covers_every_torchx_state() -> None:
    from torchx.specs import AppState  # type: ignore[import-untyped]

    assert set(TORCHX_STATES) == {state.name for state in AppState}
    cases = {
        "SUCCEEDED": JobState.COMPLETED,
        "cancelled": JobState.CANCELLED,
        "x": JobState.UNKNOWN,
    }
    for name, state in cases.items():
        assert state_from_torchx(name) is state


def test_record_keys_for_handles(tmp_path: Path) -> None:
    assert record_key("slurm://torchx/1234") == record_key("1234") == "1234"
    assert record_key("local_cwd://torchx/demo-ab1") == "local_cwd-demo-ab1"
    for bad in ("local_cwd://torchx/../x", "slurm://torchx/12;rm", "x://y/.hidden", "a://b/c/d"):
        with pytest.raises(ConfigError, match=r"torchx app handle|not a SLURM job id"):
            record_path(bad, home=tmp_path)


# --- dry runs and bad input: nothing submitted, nothing written --------------------------------


@pytest.mark.parametrize("scheduler", ["local_cwd", "slurm"])
def test_dry_run_prints_torchxs_request_and_writes_nothing(
    workdir: Path, capsys: pytest.CaptureFixture[str], scheduler: str
) -> None:
    spec = write_spec(workdir, "nodes: 2\nprocs_per_node: 1\npartition: debug\n")
    code, out, err = run(
        ["submit", str(spec), "--via", "torchx", "--scheduler", scheduler, "--dry-run"], capsys
    )
    assert code == 0, err
    assert out.startswith(f"# torchx dryrun: scheduler={scheduler} cfg=")
    joined = re.sub(r"'\s*\n\s*'", "", out)  # pprint splits long strings into adjacent ones
    assert "-m ddpkit run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d" in joined
    assert str(PAYLOAD) in joined
    if scheduler == "slurm":  # the sbatch script torchx would submit: one het group per node
        assert "sbatch --parsable $SBATCH_SCRIPT" in out
        assert "#SBATCH --job-name=demo-0 --requeue --time=5" in out
        assert "#SBATCH hetjob" in out and "--partition=debug" in out
    else:
        assert f"'log_dir': '{workdir / 'ddpkit-logs' / 'torchx'}/demo-" in out
    assert sorted(p.name for p in workdir.iterdir()) == ["job.yaml"]


def test_default_scheduler_is_local_cwd(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["submit", str(write_spec(workdir, "")), "--via", "torchx", "--dry-run"], capsys
    )
    assert code == 0 and out.startswith("# torchx dryrun: scheduler=local_cwd")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--scheduler", "slurm"], "--scheduler slurm is for --via torchx, not --via sbatch"),
        (["--via", "submitit", "--scheduler", "local_cwd"], "not --via submitit"),
        (["--via", "torchx", "--scheduler", "kubernetes"], "invalid choice: 'kubernetes'"),
    ],
)
def test_bad_flag_combinations_exit_2_and_write_nothing(
    workdir: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    spec = write_spec(workdir, "")
    for dry in ([], ["--dry-run"]):
        code, out, err = run(["submit", str(spec), *flags, *dry], capsys)
        assert (code, out) == (2, "")
        assert message in err
        assert err.count("\n") == 1 or "usage:" in err
    assert sorted(p.name for p in workdir.iterdir()) == ["job.yaml"]


def test_bad_handles_exit_2(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["status", "local_cwd://torchx/../../x"], ["cancel", "slurm://torchx/1;x"]):
        code, out, err = run(argv, capsys)
        assert (code, out) == (2, "")
        assert err.startswith("ddpkit: error: ") and err.count("\n") == 1


def test_help_and_parsing_import_no_torchx() -> None:
    code = (
        "import sys\n"
        "from ddpkit.cli import main\n"
        "main(['--help']); main(['submit', '--help']); main(['status', 'x://y/../z'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchx'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "--via {sbatch,submitit,torchx}" in done.stdout


def test_without_torchx_the_core_works_and_torchx_names_the_extra(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "")
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torchx' or name.startswith('torchx.'):\n"
        "            raise ImportError(f'blocked {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from ddpkit.cli import main\n"
        "assert main(['--help']) == 0\n"
        "print('torchx loaded:', any(m.split('.')[0] == 'torchx' for m in sys.modules))\n"
        f"assert main(['plan', {str(spec)!r}]) == 0\n"
        f"print('codes', main(['submit', {str(spec)!r}, '--via', 'torchx']),"
        f" main(['submit', {str(spec)!r}, '--via', 'torchx', '--dry-run']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "DDPKIT_HOME": str(tmp_path / "home")},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "torchx loaded: False" in done.stdout
    assert "codes 2 2" in done.stdout
    assert done.stderr.count("pip install ddpkit[torchx]") == 2, done.stderr
    assert not (tmp_path / "home").exists()


# --- a real local_cwd run --------------------------------------------------------------------


@pytest.mark.multiproc
def test_local_cwd_one_node_two_processes(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # SLURM options mean nothing on this machine: run anyway, and say so (as the dry run does)
    spec = write_spec(workdir, "procs_per_node: 2\naccount: proj-1\nsbatch: {exclusive: true}\n")
    code, out, err = run(
        ["submit", str(spec), "--via", "torchx", "--scheduler", "local_cwd"], capsys
    )
    assert code == 0, err
    handle = out.strip()
    assert re.fullmatch(r"local_cwd://torchx/demo-[a-z0-9]+", handle), out
    assert f"{handle} ended SUCCEEDED" in err
    assert "ddpkit: not used by local_cwd (SLURM options): account, sbatch.exclusive\n" in err
    record = load_record(handle)
    assert record is not None
    assert (record.via, record.handle, record.final_state) == (
        "torchx",
        handle,
        "SUCCEEDED",
    )

    assert run(["status", handle], capsys) == (0, "COMPLETED (exit code 0)\n", "")
    code, logs, _ = run(["logs", handle], capsys)
    assert code == 0
    found = sorted(reports(logs), key=lambda r: r["rank"])
    assert [(r["rank"], r["local_rank"], r["world_size"], r["launcher"]) for r in found] == [
        (0, 0, 2, "torchrun"),
        (1, 1, 2, "torchrun"),
    ]
    for rank in (0, 1):
        code, text, _ = run(["logs", handle, "--rank", str(rank)], capsys)
        assert code == 0 and [r["rank"] for r in reports(text)] == [rank]
    assert run(["cancel", handle], capsys) == (0, "", "")  # ended: nothing to do


def test_local_status_without_final_state_is_unknown_with_a_hint(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = "local_cwd://torchx/demo-abc"
    save_record(
        JobRecord(
            "demo-abc",
            "torchx",
            "demo",
            str(workdir),
            "torchx",
            1,
            2,
            str(workdir),
            handle=handle,
        )
    )
    code, out, err = run(["status", handle], capsys)
    assert (code, out) == (1, "UNKNOWN\n")
    assert "still running it, or was killed" in err and "torchx does not know" in err
    code, _, err = run(["cancel", handle], capsys)
    assert code == 2 and "Ctrl-C" in err


@pytest.mark.parametrize("digit", ["²", "３", "٣"])
def test_log_files_skip_replica_files_numbered_in_another_scripts_digits(
    tmp_path: Path, digit: str
) -> None:
    """torchx's file names in a shared folder: ``²`` made ``int()`` raise, ``٣`` read as 3."""
    from ddpkit.jobs.backends.torchx import BACKEND
    from ddpkit.jobs.records import JobRecord

    for handle, good, planted in [
        ("slurm://torchx/55", "slurm-55-ddpkit-0.out", f"slurm-55-ddpkit-{digit}.out"),
        ("local_cwd://torchx/demo-1", "ddpkit/0/combined.log", f"ddpkit/{digit}/combined.log"),
    ]:
        folder = tmp_path / handle.split(":")[0]
        for name in (good, planted):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text("x\n")
        record = JobRecord(
            job_id="55", via="torchx", name="demo", log_dir=str(folder), launch="torchrun",
            nodes=1, procs_per_node=1, workdir=str(tmp_path), handle=handle,
        )  # fmt: skip
        files, _ = BACKEND.log_files(handle, record, rank=0)
        assert [file.path for file in files] == [folder / good], handle


_SLEEPER = """
import os, sys, time
with open(sys.argv[1], "w") as out:
    out.write(str(os.getpid()))
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.multiproc
def test_a_stop_signal_to_a_foreground_local_run_cancels_it_and_records_it(tmp_path: Path) -> None:
    """`ddpkit submit --via torchx` runs a local_cwd app in the foreground: Ctrl-C (here, from
    another process, to a whole interpreter) ends its processes and records CANCELLED, in one
    line. torchx's own handlers, left in place, raised its SignalException instead: a traceback,
    and a record with no final state. SIGTERM takes the same handler: it is sent at the same
    moment, in this process, by the moments test below ("waiting")."""
    signum = signal.SIGINT
    (tmp_path / "sleeper.py").write_text(_SLEEPER)
    pid_file = tmp_path / "worker.pid"
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: demo\ncommand: sleeper.py {pid_file}\ntime_min: 5\n")
    home = tmp_path / "home"
    submit = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "submit", str(spec), "--via", "torchx"],
        cwd=tmp_path,
        env={**os.environ, "DDPKIT_HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not pid_file.exists() or not pid_file.read_text():
            assert submit.poll() is None, submit.communicate()
            assert time.monotonic() < deadline, "the app's worker never started"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        submit.send_signal(signum)
        out, err = submit.communicate(timeout=60)
    finally:
        if submit.poll() is None:
            submit.kill()
            submit.communicate()
    assert submit.returncode == 1, err
    assert "Traceback" not in err, err
    handle = out.strip()
    assert f"ddpkit: {handle} ended CANCELLED\n" in err, err
    record = json.loads(next((home / "jobs").glob("local_cwd-*.json")).read_text())
    assert (record["handle"], record["final_state"]) == (handle, "CANCELLED")
    deadline = time.monotonic() + 30
    while _alive(worker):  # torchx's cancel sends its process group SIGTERM, then ddpkit run's
        assert time.monotonic() < deadline, f"the app's worker {worker} outlived its submitter"
        time.sleep(0.1)


def test_a_local_dry_run_leaves_the_callers_signal_handlers_as_they_were(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchx's local scheduler sets SIGINT and SIGTERM handlers when it is made, and never puts
    the caller's back: ddpkit does, so that Ctrl-C in a program using the API stays
    KeyboardInterrupt."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    code, _, err = run(
        ["submit", str(write_spec(workdir, "")), "--via", "torchx", "--dry-run"], capsys
    )
    assert code == 0, err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


# The moments of a local submission a stop signal can come at: torchx making a scheduler (and
# setting its handlers) for the dry run a submission begins with, that runner's close, then a
# scheduler for the submission, a replica started but not yet noted by torchx (which the
# runner's close kills), every replica started, the record saved, the wait for the app's end
# begun (where a Ctrl-C in the terminal mostly comes); and once the app has ended
# by itself, as the runner closes. Each is a real local_cwd run, the signal raised in this
# process at that moment (a window of milliseconds no outside timing hits on demand).
_MOMENTS = (
    "dry run",
    "dry run closed",
    "handlers set",
    "replica started",
    "scheduled",
    "record saved",
    "waiting",
    "ended",
)


@pytest.mark.multiproc
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("moment", _MOMENTS)
def test_a_stop_signal_at_any_moment_of_a_local_submission_leaves_no_process_or_traceback(
    workdir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    moment: str,
    signum: int,
) -> None:
    """Before ddpkit held the signals over the start, torchx's handler raised its exception:
    a traceback, and at "replica started" a replica nothing would stop (torchx had not noted
    it, so the runner's close did not kill it: it ran on, in a session of its own)."""
    from torchx.runner import api as runner_api
    from torchx.schedulers import local_scheduler

    from ddpkit.jobs.backends import torchx as backend

    replicas: list[int] = []
    made: list[str] = []  # schedulers made and runners closed: the dry run's, the submission's

    def at(name: str) -> None:
        if name == moment:
            signal.raise_signal(signum)

    register = local_scheduler._register_termination_signals
    popen = local_scheduler.LocalScheduler._popen
    schedule = local_scheduler.LocalScheduler.schedule
    save = backend.save_record
    close = runner_api.Runner.close
    wait = runner_api.Runner.wait

    def registered() -> None:
        register()
        made.append("made")
        at("dry run" if made.count("made") == 1 else "handlers set")

    def started(self: Any, *args: Any, **kwargs: Any) -> Any:
        replica = popen(self, *args, **kwargs)
        replicas.append(replica.proc.pid)
        at("replica started")
        return replica

    def scheduled(self: Any, *args: Any, **kwargs: Any) -> Any:
        app_id = schedule(self, *args, **kwargs)
        at("scheduled")
        return app_id

    def saved(record: JobRecord) -> None:
        save(record)
        at("record saved")

    def waiting(self: Any, *args: Any, **kwargs: Any) -> Any:
        at("waiting")
        return wait(self, *args, **kwargs)

    def closed(self: Any) -> None:
        made.append("closed")
        at("dry run closed" if made.count("closed") == 1 else "ended")
        close(self)

    monkeypatch.setattr(local_scheduler, "_register_termination_signals", registered)
    monkeypatch.setattr(local_scheduler.LocalScheduler, "_popen", started)
    monkeypatch.setattr(local_scheduler.LocalScheduler, "schedule", scheduled)
    monkeypatch.setattr(backend, "save_record", saved)
    monkeypatch.setattr(runner_api.Runner, "close", closed)
    monkeypatch.setattr(runner_api.Runner, "wait", waiting)
    (workdir / "sleeper.py").write_text(_SLEEPER)
    spec = workdir / "job.yaml"
    sleep_s = " 0" if moment == "ended" else ""  # the others are stopped long before 120 s
    spec.write_text(
        f"name: demo\ncommand: sleeper.py {workdir / 'worker.pid'}{sleep_s}\ntime_min: 5\n"
    )
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    code, out, err = run(["submit", str(spec), "--via", "torchx"], capsys)

    assert "Traceback" not in err, err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    records = sorted((workdir / "home" / "jobs").glob("local_cwd-*.json"))
    if moment in ("dry run", "dry run closed", "handlers set"):  # nothing had started
        assert (code, out, err) == (130, "", "ddpkit: interrupted\n")
        assert (replicas, records) == ([], [])
        return
    handle = out.strip()
    final, want = ("SUCCEEDED", 0) if moment == "ended" else ("CANCELLED", 1)  # too late for it
    assert (code, err.splitlines()[-1]) == (want, f"ddpkit: {handle} ended {final}"), err
    assert [json.loads(path.read_text())["final_state"] for path in records] == [final]
    assert replicas, "no replica started"
    deadline = time.monotonic() + 30
    while alive := [pid for pid in replicas if _alive(pid)]:
        assert time.monotonic() < deadline, f"replicas {alive} outlived the submission"
        time.sleep(0.1)
