"""Bad nodes: the health reports, whom they blame, the exclusion plan and its caps (pure, table
tests), and the act (``scontrol requeue`` then ``scontrol update ExcNodeList``) through the fake
Runner, with its corner cases: a record from earlier attempts, a failing scontrol, an array
task, hostile node names. The real cluster: tests/jobs/test_health_check_cluster.py."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from ddpkit.cluster.slurmtools import CommandResult
from ddpkit.cluster.stop import exclude
from ddpkit.cluster.stop.blamed import record_blame, take_blamed
from ddpkit.cluster.stop.exclude import (
    EXIT_FAILED,
    EXIT_REQUEUED,
    blame,
    plan_exclusion,
    read_record,
    read_reports,
    record_path,
)
from ddpkit.cluster.stop.health import report_line
from ddpkit.cluster.stop.requeue import RequeuePlan
from ddpkit.errors import DdpkitError
from tests.fakes.slurm import OK, FakeSlurm, scontrol_line

NO_REPORT = exclude._NO_REPORT

# exclude.main ignores SIGTERM in the process it owns (a requeue's TERM must not cut the update
# short): in pytest's process, every later test's children inherited that (a `sleep` sent
# SIGTERM in tests/support/test_pids.py lived on)
pytestmark = pytest.mark.usefixtures("signals_put_back")


# ---------------------------------------------------------------------------- reports, blame


def test_reports_are_read_among_other_lines_and_odd_ones_are_left_out() -> None:
    text = "\n".join([
        "srun: warning: something",
        report_line("n1", None),
        report_line("n2", "exit code 1: disk full"),
        json.dumps({"ddpkit_health": 1, "node": "n3;rm -rf ~", "ok": True, "why": None}),
        json.dumps({"ddpkit_health": 2, "node": "n4", "ok": True, "why": None}),
        json.dumps(["ddpkit_health", "n5"]),
        json.dumps({"ddpkit_health": 1, "node": "n6", "ok": "yes", "why": None}),
        '{"ddpkit_health": 1, "node": "n7", "ok": tru',
        "",
    ])  # fmt: skip
    assert read_reports(text) == {
        "n1": None,
        "n2": "exit code 1: disk full",
        "n6": "health check failed",  # only a true "ok" passes
    }


def test_a_failed_report_of_a_node_is_not_undone_by_a_passing_one() -> None:
    text = f"{report_line('n1', 'timed out after 5 s')}\n{report_line('n1', None)}\n"
    assert read_reports(text) == {"n1": "timed out after 5 s"}


def test_blame_names_failed_and_silent_nodes_of_the_job_in_its_order() -> None:
    reports = {"n3": "exit code 2: no GPU", "n1": None, "n9": "not the job's"}
    assert blame(["n3", "n2", "n1"], reports) == {
        "n3": "health check failed: exit code 2: no GPU",
        "n2": NO_REPORT,
    }
    assert blame(["n1"], {"n1": None}) == {}


# ---------------------------------------------------------------------------- the plan


def plan(
    blamed: dict[str, str],
    *,
    excluded: Sequence[str] = (),
    ours: Sequence[str] = (),
    max_excluded: int = 2,
    restarts: int = 0,
    target: str | None = "17",
    partition: Sequence[str] | None = None,
    min_nodes: int | None = None,
) -> exclude.Verdict:
    why = "requeue cap reached (...)" if target is None else f"requeue {target} (1 of 10)"
    return plan_exclusion(
        blamed,
        job_nodes=["n1", "n2"],
        excluded=excluded,
        ours=ours,
        max_excluded=max_excluded,
        requeue_plan=RequeuePlan(target, why, restarts),
        partition_nodes=partition,
        min_nodes=min_nodes,
    )


BAD = {"n1": "health check failed: exit code 1: bad"}


def test_no_blame_runs_on() -> None:
    verdict = plan({}, restarts=2)
    assert (verdict.action, verdict.lines) == ("run", ["health check passed on n1, n2 (attempt 2)"])


def test_a_blamed_node_is_added_to_the_jobs_own_excludes_and_the_job_requeued() -> None:
    verdict = plan(BAD, excluded=["n4"], partition=["n1", "n2", "n3", "n4"])
    assert verdict.action == "requeue"
    assert verdict.exclude == ["n4", "n1"]  # the submission's n4 kept, not counted
    assert verdict.ours == ["n1"]
    assert verdict.lines == [
        "node n1: health check failed: exit code 1: bad",
        "excluding node n1 (health check failed: exit code 1: bad); requeue attempt 1, "
        "excluded: n1 (1 of max 2)",
    ]


def test_earlier_exclusions_count_against_the_cap() -> None:
    verdict = plan({"n2": NO_REPORT}, excluded=["n4", "n1"], ours=["n1"], restarts=1)
    assert verdict.action == "requeue"
    assert verdict.exclude == ["n4", "n1", "n2"]
    assert verdict.lines[-1] == (
        f"excluding node n2 ({NO_REPORT}); requeue attempt 2, excluded: n1, n2 (2 of max 2)"
    )


def test_several_nodes_at_once_are_named_each_with_its_reason() -> None:
    verdict = plan({"n1": "a", "n2": "b"}, max_excluded=3)
    assert verdict.action == "requeue"
    assert verdict.lines[-1] == (
        "excluding nodes n1, n2 (n1: a; n2: b); requeue attempt 1, excluded: n1, n2 (2 of max 3)"
    )


@pytest.mark.parametrize(
    ("blamed", "ours", "max_excluded", "says"),
    [
        (BAD, [], 0, "max_excluded_nodes=0 would be exceeded (1 nodes)"),
        ({"n2": "x"}, ["n1"], 1, "max_excluded_nodes=1 would be exceeded (2 nodes; excluded so "
         "far: n1)"),
        ({"n1": "x", "n2": "y"}, [], 1, "not excluding n1, n2: max_excluded_nodes=1"),
    ],
)  # fmt: skip
def test_past_the_cap_nothing_is_excluded_and_the_job_fails(
    blamed: dict[str, str], ours: list[str], max_excluded: int, says: str
) -> None:
    verdict = plan(blamed, ours=ours, max_excluded=max_excluded)
    assert verdict.action == "fail"
    assert says in verdict.lines[-1]
    assert verdict.lines[-1].endswith(
        "the job fails (raise max_excluded_nodes in the job spec, or repair the nodes)"
    )
    assert verdict.exclude == []


def test_the_requeue_cap_also_ends_it() -> None:
    verdict = plan(BAD, target=None)
    assert verdict.action == "fail"
    assert verdict.lines[-1] == "not excluding n1: requeue cap reached (...); the job fails"


def test_an_exclusion_that_leaves_too_few_nodes_in_the_partition_fails() -> None:
    verdict = plan(BAD, excluded=["n4"], partition=["n1", "n2", "n3", "n4"], max_excluded=2)
    assert verdict.action == "requeue"  # n2, n3 are left: enough for 2 nodes
    verdict = plan(BAD, excluded=["n4", "n3"], partition=["n1", "n2", "n3", "n4"])
    assert verdict.action == "fail"
    assert verdict.lines[-1] == (
        "not excluding n1: it would leave 1 node(s) for a job of 2 (excluded: n4, n3, n1); "
        "the job fails"
    )


@pytest.mark.parametrize(
    ("excluded", "min_nodes", "action"),
    [
        (["n4", "n3"], 1, "requeue"),  # n2 is left: enough for a job of nodes: 1-2
        (["n4", "n3"], 2, "fail"),  # nodes: 2-3 on 2 nodes now: n2 alone is too few
        (["n4", "n3", "n2"], 1, "fail"),  # nothing left at all
        (["n4"], 1, "requeue"),
    ],
)
def test_a_node_range_counts_its_min_not_the_nodes_it_has(
    excluded: list[str], min_nodes: int, action: str
) -> None:
    verdict = plan(BAD, excluded=excluded, partition=["n1", "n2", "n3", "n4"], min_nodes=min_nodes)
    assert verdict.action == action, verdict.lines
    if action == "fail":
        left = 4 - len(excluded) - 1
        assert verdict.lines[-1] == (
            f"not excluding n1: it would leave {left} node(s) for a job of at least {min_nodes} "
            f"(excluded: {', '.join([*excluded, 'n1'])}); the job fails"
        )
    else:
        assert verdict.exclude == [*excluded, "n1"]


# ---------------------------------------------------------------------------- the act


ENV = {
    "SLURM_JOB_ID": "17",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_RESTART_COUNT": "0",
    "DDPKIT_MAX_REQUEUES": "10",
}
REPORTS = f"{report_line('n1', 'exit code 1: bad')}\n{report_line('n2', None)}\n"


def fake(
    exc: str = "n4",
    *,
    req: str = "(null)",
    requeue: CommandResult = OK,
    update: CommandResult = OK,
) -> FakeSlurm:
    def scontrol(argv: Sequence[str], stdin: str | None) -> CommandResult:
        if argv[1] == "show":
            extra = f"ReqNodeList={req} ExcNodeList={exc} "
            return CommandResult(0, scontrol_line(argv[-1], "RUNNING", extra=extra), "")
        return requeue if argv[1] == "requeue" else update

    sinfo = CommandResult(0, "".join(f"n{i} idle\n" for i in range(1, 7)), "")
    return FakeSlurm(scontrol=scontrol, sinfo=sinfo)


def test_requeue_comes_before_the_update_and_the_record_counts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slurm = fake()
    code = exclude.run(REPORTS, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm)
    assert code == EXIT_REQUEUED
    assert [argv for argv, _ in slurm.calls] == [
        ["scontrol", "show", "job", "--oneliner", "17"],
        ["sinfo", "--noheader", "--Node", "--partition", "debug", "-o", "%N %t"],
        ["scontrol", "requeue", "17"],  # first: SLURM updates ExcNodeList of pending jobs only
        ["scontrol", "update", "JobId=17", "ExcNodeList=n4,n1"],
    ]
    assert read_record(record_path(tmp_path, "17")) == ["n1"]
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "ddpkit: node n1: health check failed: exit code 1: bad",
        "ddpkit: excluding node n1 (health check failed: exit code 1: bad); requeue attempt 1, "
        "excluded: n1 (1 of max 2)",
    ]

    # the next attempt, on n2 and n3, blames n3: the record makes it 2 of 2; a third fails
    env = ENV | {"SLURM_JOB_NODELIST": "n[2-3]", "SLURM_RESTART_COUNT": "1"}
    reports = f"{report_line('n2', None)}\n"  # n3 sent nothing
    slurm = fake("n[1,4]")
    assert exclude.run(reports, env, max_excluded=2, record_dir=str(tmp_path), runner=slurm) == 3
    assert slurm.calls[-1][0] == ["scontrol", "update", "JobId=17", "ExcNodeList=n1,n4,n3"]
    assert read_record(record_path(tmp_path, "17")) == ["n1", "n3"]
    env = ENV | {"SLURM_JOB_NODELIST": "n[2,4]", "SLURM_RESTART_COUNT": "2"}
    slurm = fake("n[1,3-4]")
    code = exclude.run(reports, env, max_excluded=2, record_dir=str(tmp_path), runner=slurm)
    assert code == EXIT_FAILED
    assert "requeue" not in [argv[1] for argv, _ in slurm.calls]
    assert "max_excluded_nodes=2 would be exceeded (3 nodes; excluded so far: n1, n3)" in (
        capsys.readouterr().err
    )


def test_min_nodes_from_the_command_line_lets_a_range_requeue_on_the_last_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a nodes: 1-2 job confined to n1, n2 (sbatch: {exclude: 'n[3-4]'}) blames n1: n2 is left
    monkeypatch.setattr("sys.stdin", io.StringIO(REPORTS))
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    runs: list[FakeSlurm] = []

    def run(*args: object, **kwargs: object) -> int:
        runs.append(fake("n[3-4]"))
        runs[-1].answers["sinfo"] = CommandResult(0, "n1 mix\nn2 mix\nn3 idle\nn4 idle\n", "")
        return real_run(*args, **kwargs, runner=runs[-1])  # type: ignore[arg-type]

    real_run = exclude.run
    monkeypatch.setattr(exclude, "run", run)
    argv = ["--max-excluded", "2", "--record-dir", str(tmp_path)]
    assert exclude.main(argv) == EXIT_FAILED  # as a fixed nodes: 2 job: one node is too few
    assert "it would leave 1 node(s) for a job of 2" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO(REPORTS))
    assert exclude.main([*argv, "--min-nodes", "1"]) == EXIT_REQUEUED
    assert runs[-1].calls[-1][0] == ["scontrol", "update", "JobId=17", "ExcNodeList=n3,n4,n1"]
    assert "excluding node n1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        exclude.main([*argv, "--min-nodes", "0"])


def test_healthy_nodes_ask_slurm_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slurm = fake()
    reports = f"{report_line('n2', None)}\n{report_line('n1', None)}\n"
    assert exclude.run(reports, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm) == 0
    assert slurm.calls == []
    assert capsys.readouterr().err == "ddpkit: health check passed on n1, n2 (attempt 0)\n"
    assert not list(tmp_path.iterdir())


def test_an_array_task_is_excluded_as_itself(tmp_path: Path) -> None:
    env = ENV | {"SLURM_JOB_ID": "23", "SLURM_ARRAY_JOB_ID": "20", "SLURM_ARRAY_TASK_ID": "3"}
    slurm = fake("(null)")
    assert exclude.run(REPORTS, env, max_excluded=1, record_dir=str(tmp_path), runner=slurm) == 3
    assert slurm.calls[-2][0] == ["scontrol", "requeue", "20_3"]
    assert slurm.calls[-1][0] == ["scontrol", "update", "JobId=20_3", "ExcNodeList=n1"]
    assert read_record(record_path(tmp_path, "20_3")) == ["n1"]


def test_a_failed_requeue_fails_the_job_and_excludes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slurm = fake(requeue=CommandResult(1, "", "Requested operation is presently disabled\n"))
    assert exclude.run(REPORTS, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm) == 1
    assert slurm.calls[-1][0] == ["scontrol", "requeue", "17"]
    assert "could not requeue: scontrol requeue 17 failed with exit code 1: Requested " in (
        capsys.readouterr().err
    )
    assert read_record(record_path(tmp_path, "17")) == []


def test_a_failed_update_still_ends_this_run_but_counts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slurm = fake(update=CommandResult(1, "", "Job is no longer pending execution for job 17\n"))
    assert exclude.run(REPORTS, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm) == 3
    err = capsys.readouterr().err
    assert "requeued, but scontrol update JobId=17 ExcNodeList=n4,n1 failed (1): Job is no " in err
    assert "the job was requeued without excluding n1" in err
    assert read_record(record_path(tmp_path, "17")) == []


def test_an_unanswering_sinfo_skips_the_partition_check(tmp_path: Path) -> None:
    slurm = fake()
    slurm.answers["sinfo"] = CommandResult(1, "", "sinfo: error: ...\n")
    assert exclude.run(REPORTS, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm) == 3


@pytest.mark.parametrize(
    ("nodelist", "exc"),
    [("n1,n$(touch pwned)", "n4"), ("n[1-2]", "n4,x;reboot"), ("n[1-2]", "'n4 n5'")],
)
def test_hostile_node_names_are_refused_not_passed_on(
    tmp_path: Path, nodelist: str, exc: str
) -> None:
    slurm = fake(exc)
    env = ENV | {"SLURM_JOB_NODELIST": nodelist}
    with pytest.raises(DdpkitError, match=r"not a plain node name|malformed"):
        exclude.run(REPORTS, env, max_excluded=2, record_dir=str(tmp_path), runner=slurm)
    assert "requeue" not in [argv[1] for argv, _ in slurm.calls]


def test_main_turns_an_error_into_a_failed_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(REPORTS))
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-")
    assert exclude.main(["--max-excluded", "1", "--record-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ddpkit: health check: SLURM_JOB_NODELIST='n[1-' is malformed")
    assert err.rstrip().endswith("; the job fails")


def test_an_unknown_exclude_list_is_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slurm = fake()
    slurm.answers["scontrol"] = CommandResult(1, "", "slurm_load_jobs error: Socket timed out\n")
    assert exclude.run(REPORTS, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm) == 1
    assert [argv[:2] for argv, _ in slurm.calls] == [["scontrol", "show"]]
    assert "`scontrol show job 17` did not answer, so the job's ExcNodeList is not known" in (
        capsys.readouterr().err
    )


def test_a_node_the_job_requires_is_not_excluded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slurm = fake(req="n[1-2]")
    assert exclude.run(REPORTS, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm) == 1
    assert "requeue" not in [argv[1] for argv, _ in slurm.calls]
    assert "not excluding n1: the job requires it (--nodelist n1,n2); the job fails" in (
        capsys.readouterr().err
    )


def test_down_and_drained_nodes_do_not_count_as_room_left(tmp_path: Path) -> None:
    slurm = fake("(null)")
    slurm.answers["sinfo"] = CommandResult(
        0, "n1 mix\nn2 alloc\nn3 drain*\nn4 down~\nn5 drng\n", ""
    )
    assert exclude.run(REPORTS, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm) == 1
    slurm.answers["sinfo"] = CommandResult(0, "n1 mix\nn2 alloc\nn3 idle~\nn4 down\n", "")
    assert exclude.run(REPORTS, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm) == 3


# ---------------------------------------------------------------------------- after the step


def test_after_a_failed_step_only_a_failing_check_blames_a_node() -> None:
    reports = {"n1": "exit code 1: ECC errors"}  # n2 sent nothing: the job may be ending
    assert blame(["n1", "n2"], reports, step_exit=137) == {
        "n1": "health check failed after the job's step exited 137: exit code 1: ECC errors"
    }


def test_a_failed_step_on_healthy_nodes_ends_with_the_steps_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slurm = fake()
    reports = f"{report_line('n1', None)}\n"
    code = exclude.run(
        reports, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm, step_exit=7
    )
    assert code == 7
    assert slurm.calls == []
    assert capsys.readouterr().err == (
        "ddpkit: the job's step exited 7; no node failed its health check after it (not a node "
        "fault): the job ends with that code\n"
    )


def test_a_failed_step_with_a_failing_node_is_requeued_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slurm = fake()
    code = exclude.run(
        REPORTS, ENV, max_excluded=2, record_dir=str(tmp_path), runner=slurm, step_exit=3
    )
    assert code == 0  # requeued; never the step's own code, which might be EXIT_REQUEUED (3)
    assert slurm.calls[-1][0] == ["scontrol", "update", "JobId=17", "ExcNodeList=n4,n1"]
    assert (
        "ddpkit: excluding node n1 (health check failed after the job's step exited 3: exit code "
        "1: bad); requeue attempt 1, excluded: n1 (1 of max 2)"
    ) in capsys.readouterr().err
    # past the cap, the job ends with the step's code
    slurm = fake()
    code = exclude.run(
        REPORTS, ENV, max_excluded=0, record_dir=str(tmp_path), runner=slurm, step_exit=9
    )
    assert code == 9
    assert "requeue" not in [argv[1] for argv, _ in slurm.calls]


# ---------------------------------------------------------------- the watchdog's blamed nodes


def test_a_node_the_watchdog_blamed_is_excluded_after_the_failed_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {**ENV, "DDPKIT_LOG_DIR": str(tmp_path)}
    why = "rank 3 stopped sending heartbeats (killed?)"
    assert record_blame(env, "n2", why) == tmp_path / ".ddpkit-blamed-17"
    assert record_blame(env, "n2", "rank 2 stopped sending heartbeats (killed?)") is not None
    healthy = f"{report_line('n1', None)}\n{report_line('n2', None)}\n"
    slurm = fake()
    code = exclude.run(
        healthy, env, max_excluded=2, record_dir=str(tmp_path), runner=slurm, step_exit=137
    )
    assert code == 0
    assert slurm.calls[-1][0] == ["scontrol", "update", "JobId=17", "ExcNodeList=n4,n2"]
    assert (
        f"ddpkit: excluding node n2 (the watchdog after the job's step exited 137: {why}); "
        "requeue attempt 1, excluded: n2 (1 of max 2)"
    ) in capsys.readouterr().err
    assert not (tmp_path / ".ddpkit-blamed-17").exists()  # read once: a later failure is new


def test_the_watchdogs_blame_counts_only_after_a_failed_step_and_for_the_jobs_nodes(
    tmp_path: Path,
) -> None:
    env = {**ENV, "DDPKIT_LOG_DIR": str(tmp_path)}
    record_blame(env, "n9", "rank 1 stopped sending heartbeats")  # not one of the job's nodes
    healthy = f"{report_line('n1', None)}\n{report_line('n2', None)}\n"
    verdict, _ = exclude.decide(healthy, env, max_excluded=2, record_dir=str(tmp_path),
                                runner=fake(), step_exit=1)  # fmt: skip
    assert verdict.action == "fail"
    record_blame(env, "n2", "rank 1 stopped sending heartbeats")
    verdict, _ = exclude.decide(healthy, env, max_excluded=2, record_dir=str(tmp_path),
                                runner=fake())  # fmt: skip
    assert verdict.action == "run"  # before the step: health reports only, the file kept
    assert (tmp_path / ".ddpkit-blamed-17").exists()


@pytest.mark.parametrize(
    ("env", "node"),
    [
        ({"SLURM_JOB_ID": "17"}, "n1"),  # no log folder
        ({"DDPKIT_LOG_DIR": "LOGS"}, "n1"),  # no SLURM job
        ({"DDPKIT_LOG_DIR": "LOGS", "SLURM_JOB_ID": "../17"}, "n1"),
        ({"DDPKIT_LOG_DIR": "LOGS", "SLURM_JOB_ID": "17"}, "n1;reboot"),
        ({"DDPKIT_LOG_DIR": "LOGS", "SLURM_JOB_ID": "17"}, "n1\nn2"),
    ],
)
def test_no_blame_file_without_a_slurm_job_or_for_a_strange_name(
    tmp_path: Path, env: dict[str, str], node: str
) -> None:
    env = {key: value.replace("LOGS", str(tmp_path)) for key, value in env.items()}
    assert record_blame(env, node, "why") is None
    assert list(tmp_path.iterdir()) == []


def test_a_planted_symlink_is_not_followed_and_odd_lines_are_skipped(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    (tmp_path / ".ddpkit-blamed-17").symlink_to(target)
    env = {"DDPKIT_LOG_DIR": str(tmp_path), "SLURM_JOB_ID": "17"}
    assert record_blame(env, "n1", "why") is None
    assert target.read_text() == "keep\n"
    (tmp_path / ".ddpkit-blamed-17").unlink()
    (tmp_path / ".ddpkit-blamed-17").write_text("n1\tfirst\nbad name\tx\nn1\tsecond\n\n")
    assert take_blamed(tmp_path, "17") == {"n1": "first"}
