"""benchmarks/report.py: the renderer from small JSON inputs, and the runner for real."""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import report  # noqa: E402
import report_render  # noqa: E402
from report_render import Outcome  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
MACHINE = {"CPU": "test cpu, 2 cores", "torch": "2.13.0"}


def _row(figure: str, variant: str, value: float, **extra: Any) -> dict[str, Any]:
    higher = extra.pop("higher", True)
    unit = "samples/s" if higher else "s"
    return {"figure": figure, "variant": variant, "value": value, "unit": unit,
            "higher_is_better": higher, **extra}  # fmt: skip


def _doc(rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"bench": "loop", "title": "Loop", "command": "ddpkit run x.py", "rows": rows, **extra}


def test_tables_ratios_and_where_ddpkit_is_behind() -> None:
    rows = [
        _row("loop small", "plain torch", 100.0),
        _row("loop small", "ddpkit", 90.0),
        _row("loop small", "accelerate", 95.0),
        _row("launch", "torchrun", 2.0, higher=False),
        _row("launch", "ddpkit run", 2.02, higher=False),  # 1 % slower: within noise
        _row("big", "plain torch", 10.0),
        _row("big", "ddpkit", 12.0),
    ]
    doc = _doc(rows, notes=["lightning fabric: not installed (pip install ddpkit[bench])"])
    notes = {"loop": {"LOOP SMALL": "the sampler is rebuilt\neach epoch"}}
    text = report_render.render_markdown(
        [Outcome("bench_loop", "ok", 12.0, doc=doc)], MACHINE, "python benchmarks/report.py",
        notes, {"bench_loop": "bench_loop.png"},
    )  # fmt: skip
    assert "| CPU | test cpu, 2 cores |" in text
    assert "Reproduce: `python benchmarks/report.py`" in text
    assert "| bench_loop | ok | 12 | 1 |" in text  # one figure behind beyond noise
    assert "| plain torch | 100 | baseline |" in text
    assert "| **ddpkit** | 90.0 | 0.900 |" in text
    assert "| accelerate | 95.0 | 0.950 |" in text
    behind = "ddpkit behind plain torch by 10.0%; ddpkit behind accelerate by 5.3%"
    assert f"Verdict: **BEHIND**: {behind}." in text
    assert "Why: the sampler is rebuilt each epoch" in text
    assert "| **ddpkit run** | 2.02 | 1.010 |" in text
    assert "Verdict: level: ddpkit run behind torchrun by 1.0%: within noise (<= 2%)." in text
    assert "Verdict: ddpkit is at or ahead of every baseline." in text  # "big"
    assert "- lightning fabric: not installed (pip install ddpkit[bench])" in text
    assert "![loop](bench_loop.png)" in text
    assert "Command: `ddpkit run x.py`" in text


def test_behind_without_a_note_asks_for_one() -> None:
    rows = [_row("f", "torch.save", 10.0), _row("f", "ddpkit.save_checkpoint", 5.0)]
    rows += [_row("g", "sbatch", 0.01, higher=False), _row("g", "ddpkit submit", 0.5, higher=False)]
    text = report_render.render_markdown(
        [Outcome("bench_c", "ok", doc=_doc(rows, bench="checkpoint"))], MACHINE, "c", {}
    )
    assert "ddpkit.save_checkpoint behind torch.save by 50.0%" in text
    assert "ddpkit submit behind sbatch by 50.0x" in text  # 50 times the time, not 4900 %
    assert "Why: no note yet (add one to why.yaml under 'checkpoint')" in text


def test_figures_without_ddpkit_have_no_ratios_or_verdict() -> None:
    rows = [_row("phases", "saved", 0.05, higher=False), _row("phases", "ended", 3.7, higher=False)]
    text = report_render.render_markdown(
        [Outcome("bench_r", "ok", doc=_doc(rows))], MACHINE, "c", {}
    )
    assert "| variant | value |\n|---|---|\n| saved | 0.050 |\n| ended | 3.70 |" in text
    assert "Verdict" not in text


def test_failed_and_not_run_benches_are_reported() -> None:
    outcomes = [
        Outcome("bench_a", "failed", 3.0, "exit code 1", "Traceback ...\nValueError: boom"),
        Outcome("bench_b", "not run", reason="no cluster (give --slurm-env)"),
    ]
    text = report_render.render_markdown(outcomes, MACHINE, "c", {})
    assert "| bench_a | failed: exit code 1 | 3 |  |" in text
    assert "```text\nTraceback ...\nValueError: boom\n```" in text
    assert "| bench_b | not run: no cluster (give --slurm-env) | 0 |  |" in text


def test_sweep_rows_get_an_x_column_and_a_line_plot(tmp_path: Path) -> None:
    figure = "all_reduce busbw, 2 ranks"
    rows = [
        _row(figure, variant, value, x=size, unit="GB/s")
        for size, plain, ours in [(1024.0, 0.1, 0.1), (1048576.0, 2.0, 1.0)]
        for variant, value in [("plain torch", plain), ("ddpkit", ours)]
    ]
    for row in rows:
        row["unit"] = "GB/s"
    doc = _doc(rows, bench="allreduce")
    outcome = Outcome("bench_allreduce", "ok", doc=doc)
    text = report_render.render_markdown([outcome], MACHINE, "c", {})
    assert "| x | variant | value | ratio vs baseline |" in text
    assert "| 1.05e+06 | **ddpkit** | 1.00 | 0.500 |" in text
    assert "ddpkit behind plain torch by 50.0% at x=1.05e+06" in text
    bars = _doc([_row("a", "plain torch", 1.0), _row("a", "ddpkit", 2.0), _row("b", "ddpkit", 3.0)])
    for name, document in [("sweep", doc), ("bars", bars)]:
        path = report_render.plot(document, tmp_path / f"{name}.png")
        assert path.read_bytes()[:8] == PNG
        import matplotlib.image

        height, width, _ = matplotlib.image.imread(path).shape
        assert width > 300 and height > 150


def test_the_allreduce_bench_gives_each_trial_so_noise_is_not_called_a_gap() -> None:
    import bench_allreduce as bench

    # the doctor's sweep slower in two trials of three, faster in one (scheduling noise on two
    # cores): the medians alone say "behind by 50%", the trials that it was not so in most
    times = {
        bench.DDPKIT: {"1024": [3e-3, 1e-3, 3e-3]},
        bench.PLAIN: {"1024": [1e-3, 2e-3, 2e-3]},
    }
    found = bench.rows(times, world=2)
    by_figure = {(row["figure"], row["variant"]): row for row in found}
    mine = by_figure["all_reduce time", bench.DDPKIT]
    assert mine["trials"] == pytest.approx([3000.0, 1000.0, 3000.0]) and mine["value"] == 3000.0
    busbw = by_figure["all_reduce busbw", bench.PLAIN]
    assert busbw["value"] == pytest.approx(statistics.median(busbw["trials"]))
    doc = _doc(found, bench="allreduce")
    assert report_render.check_document(doc) == ""
    times[bench.DDPKIT]["1024"] = [3e-3, 3e-3, 4e-3]  # worse in every trial: behind
    behind = _doc(bench.rows(times, world=2), bench="allreduce")
    for document, verdict in [(doc, "Verdict: level: "), (behind, "Verdict: **BEHIND**")]:
        text = report_render.render_markdown([Outcome("bench_allreduce", "ok", doc=document)],
                                             MACHINE, "c", {})  # fmt: skip
        assert verdict in text


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ([], "the JSON is not an object"),
        ({"bench": "a", "title": "t", "command": "c"}, "no 'rows'"),
        (_doc([{"figure": "f", "variant": "v", "value": "1", "unit": "s"}]), "'value' is missing"),
        (_doc([{**_row("f", "v", 1.0), "value": True}]), "'value' is missing or not a number"),
        (_doc([{**_row("f", "v", 1.0), "higher_is_better": 1}]), "'higher_is_better'"),
        (_doc([_row("f", "v", 1.0, x="big")]), "'x' is not a number"),
        (_doc([_row("f", "v", 1.0, trials=[1, "2"])]), "'trials' is not a list of numbers"),
    ],
)
def test_documents_breaking_the_protocol_are_named(doc: object, problem: str) -> None:
    assert problem in report_render.check_document(doc)
    assert report_render.check_document(_doc([_row("f", "v", 1.0, x=3)])) == ""


def test_a_real_bench_through_the_runner(tmp_path: Path) -> None:
    code = report.main(["--only", "checkpoint", "--quick", "--out", str(tmp_path)], environ={})
    assert code == 0, (tmp_path / "logs" / "bench_checkpoint.log").read_text()
    doc = json.loads((tmp_path / "results.json").read_text())["outcomes"][0]["doc"]
    assert doc["bench"] == "checkpoint"
    assert doc["command"] == "python benchmarks/bench_checkpoint.py --quick"
    variants = {row["variant"] for row in doc["rows"]}
    assert {"ddpkit.save_checkpoint", "torch.save, same path"} <= variants
    assert "torch.distributed.checkpoint.load" in variants
    # the load's baseline resumes (load_state_dict after torch.load); deserializing alone is a
    # floor shown as a reference, never a baseline ddpkit is called behind
    assert "torch.load + load_state_dict" in variants
    assert all(row["value"] > 0 and row["unit"] == "MB/s" for row in doc["rows"])
    text = (tmp_path / "REPORT.md").read_text()
    assert "| bench_checkpoint | ok |" in text and "![checkpoint](bench_checkpoint.png)" in text
    assert "| extra: torch.load alone, deserialize only (reference) |" in text
    assert (tmp_path / "bench_checkpoint.png").read_bytes()[:8] == PNG
    (tmp_path / "REPORT.md").unlink()
    assert report.main(["--render-only", "--out", str(tmp_path)], environ={}) == 0
    assert (tmp_path / "REPORT.md").read_text() == text  # the same report from results.json


# A bench for the merge: a stub of bench_checkpoint.py (the real one runs through the runner in
# test_a_real_bench_through_the_runner; what is tested here is which outcomes are kept).
STUB_CHECKPOINT = (
    "import json, sys\n"
    "quick = ' --quick' if '--quick' in sys.argv else ''\n"
    "doc = {'bench': 'checkpoint', 'title': 'Checkpoint', 'rows': [{'figure': 'checkpoint save',\n"
    "       'variant': 'ddpkit.save_checkpoint', 'value': 2.0, 'unit': 'MB/s',\n"
    "       'higher_is_better': True}],\n"
    "       'command': 'python benchmarks/bench_checkpoint.py' + quick}\n"
    "json.dump(doc, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n"
)
RAN = "import pathlib, sys\npathlib.Path(sys.argv[0] + '.ran').touch()\nraise SystemExit(1)\n"


def test_merge_re_runs_only_the_named_bench_and_keeps_the_others(tmp_path: Path) -> None:
    benches = tmp_path / "benches"
    benches.mkdir()
    (benches / "bench_checkpoint.py").write_text(STUB_CHECKPOINT)
    (benches / "bench_a.py").write_text(RAN)  # must not run: it is not named
    old = _doc([_row("checkpoint save", "ddpkit.save_checkpoint", 1.0)], bench="checkpoint")
    kept = _doc([_row("a", "plain torch", 1.0), _row("a", "ddpkit", 1.0)], bench="a")
    earlier = {
        "machine": {**MACHINE, "date": "2026-01-01 00:00 UTC"},
        "command": "python benchmarks/report.py",
        "outcomes": [
            {"name": "bench_a", "status": "ok", "doc": kept},
            {"name": "bench_checkpoint", "status": "ok", "doc": old},
        ],
    }
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    argv = ["--only", "checkpoint", "--quick", "--merge", "--out", str(tmp_path)]
    argv += ["--benchmarks", str(benches)]
    assert report.main(argv, environ={}) == 0, tmp_path / "logs" / "bench_checkpoint.log"
    assert not (benches / "bench_a.py.ran").exists()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [o["name"] for o in saved["outcomes"]] == ["bench_a", "bench_checkpoint"]
    assert saved["outcomes"][0]["doc"] == kept  # untouched
    fresh = saved["outcomes"][1]["doc"]
    assert fresh["command"] == "python benchmarks/bench_checkpoint.py --quick"
    assert fresh["rows"][0]["value"] == 2.0  # this run's, not the earlier 1.0
    assert saved["machine"]["date"] == "2026-01-01 00:00 UTC"
    assert saved["command"].startswith("python benchmarks/report.py; then re-run on 20")
    assert saved["command"].endswith("with --only checkpoint")
    text = (tmp_path / "REPORT.md").read_text()
    assert "| bench_a | ok |" in text and "| bench_checkpoint | ok |" in text
    with pytest.raises(SystemExit):
        report.main(["--merge", "--out", str(tmp_path)], environ={})


def test_render_only_picks_up_a_why_note_written_afterwards(tmp_path: Path) -> None:
    rows = [_row("save", "torch.save", 10.0), _row("save", "ddpkit.save_checkpoint", 5.0)]
    outcome = {"name": "bench_c", "status": "ok", "seconds": 3.0, "doc": _doc(rows)}
    saved = {"machine": MACHINE, "command": "python benchmarks/report.py", "outcomes": [outcome]}
    (tmp_path / "results.json").write_text(json.dumps(saved))
    why = tmp_path / "why.yaml"
    why.write_text("loop:\n  save: fsync first\n")
    assert report.main(["--render-only", "--out", str(tmp_path), "--why", str(why)]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    assert "ddpkit.save_checkpoint behind torch.save by 50.0%" in text
    assert "Why: fsync first" in text and "| CPU | test cpu, 2 cores |" in text
    assert (tmp_path / "bench_c.png").read_bytes()[:8] == PNG


BOOM = "import sys\nprint('partial output')\nraise ValueError('boom 42')\n"
BAD_JSON = (
    "import sys\npath = sys.argv[sys.argv.index('--json') + 1]\n"
    "open(path, 'w').write('{\"bench\": \"bad\"}')\n"
)
CLUSTER = "# report-needs: slurm\nraise SystemExit('must not run without a cluster')\n"
OPTION = (
    'import argparse\nargparse.ArgumentParser().add_argument("--slurm-env")\nraise SystemExit(1)\n'
)


def test_failures_are_reported_and_make_the_exit_code(tmp_path: Path) -> None:
    benches = tmp_path / "benches"
    benches.mkdir()
    for name, text in [("boom", BOOM), ("bad", BAD_JSON), ("cluster", CLUSTER), ("opt", OPTION)]:
        (benches / f"bench_{name}.py").write_text(text)
    out = tmp_path / "out"
    argv = ["--benchmarks", str(benches), "--out", str(out), "--why", str(tmp_path / "none")]
    assert report.main(argv, environ={}) == 1
    text = (out / "REPORT.md").read_text()
    assert "| bench_boom | failed: exit code 1 |" in text
    assert "ValueError: boom 42" in text
    assert "| bench_bad | failed: bad --json output: the JSON has no 'title' |" in text
    assert "| bench_cluster | not run: no cluster (give --slurm-env) | 0 |" in text
    assert "| bench_opt | not run: no cluster (give --slurm-env) | 0 |" in text
    assert "partial output" in (out / "logs" / "bench_boom.log").read_text()
    assert not list(out.glob("*.png"))
    with pytest.raises(SystemExit):
        report.main(["--benchmarks", str(benches), "--only", "nosuch"], environ={})


def test_references_are_shown_but_never_a_baseline_ddpkit_is_behind() -> None:
    rows = [
        _row("busbw", "ddpkit doctor", 1.0, x=4.0),
        _row("busbw", "plain torch", 1.0, x=4.0),
        _row("busbw", "raw socket, one TCP stream", 9.0, x=4.0),  # marked by why.yaml
        _row("time", "ddpkit run", 2.0, higher=False),
        _row("time", "memcpy", 0.1, higher=False, reference=True),  # marked by the bench
        _row("time", "torchrun", 2.0, higher=False),
    ]
    doc = _doc(rows, command="python bench_x.py --json /tmp/a.json --quick")
    notes = {"_references": ["raw socket"]}
    text = report_render.render_markdown([Outcome("bench_x", "ok", doc=doc)], MACHINE, "c", notes)
    assert "| 4 | raw socket, one TCP stream (reference) | 9.00 | 9.000 |" in text
    assert "| memcpy (reference) | 0.100 | 0.050 |" in text
    assert "| **ddpkit run** | 2.00 | 1.000 |" in text and "| torchrun | 2.00 | baseline |" in text
    assert "BEHIND" not in text and text.count("at or ahead of every baseline") == 2
    assert "Command: `python bench_x.py --quick`" in text  # the report's temporary --json left out


def test_a_bench_without_figures_shows_why() -> None:
    outcome = Outcome("bench_dp", "ok", 1.0, doc=_doc([]), output_tail="no CUDA device here")
    text = report_render.render_markdown([outcome], MACHINE, "c", {})
    assert "No figures from this run; its output ends:\n\n```text\nno CUDA device here\n```" in text


@pytest.mark.parametrize(
    ("ours", "verdict"),
    [
        # ddpkit worse in 4 of 7 trials run side by side: a 10 % gap of medians is noise
        (
            [9, 11, 9, 11, 9, 11, 9],
            "level: ddpkit behind plain torch by 10.0%, worse in 4 of 7 "
            "trials: within noise (not in most trials).",
        ),
        # worse in 6 of 7: behind
        (
            [9, 9, 9, 9, 9, 9, 11],
            "**BEHIND**: ddpkit behind plain torch by 10.0%, worse in 6 of 7 trials.",
        ),
    ],
)
def test_trials_run_side_by_side_decide_what_is_noise(ours: list[float], verdict: str) -> None:
    rows = [
        _row("loop", "plain torch", 10.0, trials=[10.0] * 7),
        _row("loop", "ddpkit", 9.0, trials=ours),
    ]
    text = report_render.render_markdown(
        [Outcome("bench_l", "ok", doc=_doc(rows))], MACHINE, "c", {}
    )
    assert f"Verdict: {verdict}" in text


def test_a_ddpkit_variant_can_be_the_baseline() -> None:
    rows = [
        _row("all running", "ddpkit sweep", 0.8, higher=False),
        _row("all running", "ddpkit submit xN", 1.2, higher=False),  # marked by why.yaml
        _row("all running", "submitit map_array", 0.5, higher=False),
    ]
    notes = {"_baselines": ["ddpkit submit xN"]}
    text = report_render.render_markdown(
        [Outcome("bench_s", "ok", doc=_doc(rows))], MACHINE, "c", notes
    )
    assert "| **ddpkit sweep** | 0.800 | 0.667 |" in text
    assert "| ddpkit submit xN | 1.20 | baseline |" in text
    assert "| submitit map_array | 0.500 | 0.417 |" in text
    assert "Verdict: **BEHIND**: ddpkit sweep behind submitit map_array by 60.0%." in text
    assert "ddpkit submit xN behind" not in text and "(reference)" not in text


def test_figures_from_a_gpu_machine_are_shown_as_measured_there(tmp_path: Path) -> None:
    rows = [_row("loop cnn", "plain torch", 9000.0), _row("loop cnn", "ddpkit", 9100.0)]
    saved = {"machine": MACHINE, "command": "python benchmarks/report.py", "outcomes": []}
    (tmp_path / "results.json").write_text(json.dumps(saved))
    (tmp_path / "device").mkdir()
    gpu = _doc(rows, bench="loop_h100", title="Loop on one H100")
    (tmp_path / "device" / "loop-h100.json").write_text(json.dumps(gpu))
    (tmp_path / "device" / "broken.json").write_text(json.dumps({"rows": 3}))
    assert report.main(["--render-only", "--out", str(tmp_path)], environ={}) == 1
    text = (tmp_path / "REPORT.md").read_text()
    assert "## Loop on one H100" in text
    assert "`ci/gpu-check.sh` on a lent GPU machine (results/device/loop-h100.json): ok" in text
    assert "| **ddpkit** | 9,100 | 1.011 |" in text
    assert "| device_broken | failed: bad broken.json: the JSON has no 'bench' |" in text
    assert (tmp_path / "device_loop-h100.png").read_bytes()[:8] == PNG


HANGS_WITH_A_CHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(300)\n"
)


def test_a_bench_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    """bench_scale's rank holders outlived the bench the report had timed out, loading the
    machine for minutes: the bench's whole process group goes."""
    benches = tmp_path / "benches"
    benches.mkdir()
    (benches / "bench_hang.py").write_text(HANGS_WITH_A_CHILD)
    out = tmp_path / "out"
    argv = ["--benchmarks", str(benches), "--out", str(out), "--timeout-s", "3"]
    assert report.main([*argv, "--why", str(tmp_path / "none")], environ={}) == 1
    assert "| bench_hang | failed: timed out after 3 s |" in (out / "REPORT.md").read_text()
    log = (out / "logs" / "bench_hang.log").read_text()
    child = int(log.splitlines()[1])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and b"Z" not in _state(child):
        assert time.monotonic() < deadline, f"the bench's child {child} still runs"
        time.sleep(0.05)


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return b"Z"


def test_the_requeue_bench_compares_with_submitits_requeue_and_shows_a_fresh_start() -> None:
    import bench_requeue as bench
    import yaml

    def marks(resumed: float) -> dict[str, float]:
        return {"saved": 0.05, "left": 0.06, "ended": 3.8, "running": 15.9, "resumed": resumed}

    ours, peer = [marks(19.0), marks(18.0)], [marks(20.0), marks(21.0)]
    found = bench.rows([2.5, 2.6], ours, peer)
    by = {(row["figure"], row["variant"]): row for row in found}
    again = "back to training (median of 2)"
    assert (
        by[again, bench.DDPKIT]["trials"] == [19.0, 18.0]
        and by[again, bench.DDPKIT]["value"] == 18.5
    )
    assert by[again, bench.SUBMITIT]["value"] == 20.5
    assert by["seconds after the stop signal, submitit (median of 2; 2 nodes x 1 process)", "ended"]
    notes = yaml.safe_load((BENCH / "why.yaml").read_text())
    doc = _doc(found, bench="requeue")
    assert report_render.check_document(doc) == ""
    text = report_render.render_markdown(
        [Outcome("bench_requeue", "ok", doc=doc)], MACHINE, "c", notes
    )
    # the fresh submission (2.5 s: it skips SLURM's KillWait and requeue hold) is no baseline
    assert f"| {bench.FRESH} (reference) | 2.55 |" in text, text
    assert f"| {bench.SUBMITIT} | 20.5 | baseline |" in text
    assert "BEHIND" not in text
    peer = [marks(17.0), marks(17.5)]  # submitit back first in both trials: behind
    doc = _doc(bench.rows([2.5, 2.6], ours, peer), bench="requeue")
    text = report_render.render_markdown(
        [Outcome("bench_requeue", "ok", doc=doc)], MACHINE, "c", notes
    )
    assert f"Verdict: **BEHIND**: {bench.DDPKIT} behind {bench.SUBMITIT}" in text


@pytest.fixture
def scale_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What importing scalesim sets (setdefault) when no test set it first: set here, undone
    after the test, so that a test run alone or first leaks nothing."""
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:1")
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")


def test_the_scale_bench_times_ready_where_init_returns_and_counts_what_the_store_spends(
    scale_env: None,
) -> None:
    """Both variants pay the group's forming (init_process_group returns on no rank before every
    rank joined); ddpkit's ready is where init() returns, its watchdog's start-up (a connection
    of its own, then the introduction) a figure apart; the store server's CPU and the ranks'
    own are measured, not assumed. 8 simulated ranks in 2 processes, each variant once."""
    import bench_scale

    ours = bench_scale.job(8, "ddpkit", 2, 1.0)
    alone = bench_scale.job(8, "ddpkit-rendezvous", 2, 1.0)  # the watchdog off
    plain = bench_scale.job(8, "plain", 2, 1.0)
    # the watchdog's own connection is made in init(); its introduction, the thread's first
    # step, may come just before or just after init() returns
    assert 0 < ours["ready_s"] < 60 and 0 < ours["up_s"] < 60, ours
    assert 0 < alone["ready_s"] < 60 and alone["up_s"] == 0.0, alone
    assert 0 < plain["ready_s"] < 60 and plain["up_s"] == 0.0, plain
    # 7 clients: the group's client + the watchdog's own (no probe against a store that is up);
    # rank 0: its own clone
    assert ours["connections_per_rank"] == (7 * 2 + 1) / 8, ours
    assert plain["connections_per_rank"] == 1.0, plain
    # the group's 7 clients: rank 0's own client is counted only in a process instrumented as
    # the bench's main() does (its clone, above, the simulation counts itself)
    assert alone["connections_per_rank"] == 7 / 8, alone
    assert alone["calls_per_rank"] == 0.0 and alone["beat_calls_s"] == 0, alone
    for found in (ours, alone, plain):
        assert found["store_cpu_ms"] > 0 and found["client_cpu_ms"] > 0, found
        assert 0 < found["store_ready_ms"] <= found["store_cpu_ms"], found
    assert ours["link_cpu_ms"] > 0 and alone["link_cpu_ms"] == plain["link_cpu_ms"] == 0, ours
    assert ours["calls_per_rank"] == (7 * 1 + 2) / 8 and ours["max_other_calls"] == 1, ours
    assert ours["beat_calls_s"] > 0 and plain["beat_calls_s"] == 0, (ours, plain)
    assert ours["beat_burst"] >= 1.0, ours
    assert alone["beat_burst"] == plain["beat_burst"] == 0.0, (alone, plain)
    # counted for both (the kernel's counter is the machine's: other work may add to it, so
    # no exact figure here; the next test shows that it counts)
    assert ours["overflows"] >= 0 and plain["overflows"] >= 0


def test_the_scale_benchs_start_up_trials_give_start_up_figures_only(scale_env: None) -> None:
    """3 trials flagged a level start-up figure at some size in most runs (3 of 3 worse: 12.5%
    a size); the extra trials where a job is cheap skip the heartbeat window, and the window's
    figures keep the trials that had one."""
    import bench_scale

    startup = bench_scale.job(8, "ddpkit", 2, None)
    assert 0 < startup["ready_s"] < 60 and 0 < startup["up_s"] < 60, startup  # see above
    assert startup["store_ready_ms"] > 0 and startup["client_cpu_ms"] > 0, startup
    assert not {"beat_calls_s", "beat_keys_s", "beat_burst"} & set(startup), startup
    windowed = {**startup, "beat_calls_s": 7.0, "beat_keys_s": 9.0, "beat_burst": 1.5}
    results = {bench_scale.DDPKIT: {8: [windowed, startup, startup]}}
    rows, _ = bench_scale.figures(results)
    by_figure = {row["figure"]: row for row in rows}
    assert by_figure["watchdog load at the store"]["trials"] == [7.0], by_figure
    assert by_figure["time to ready"]["trials"] == [startup["ready_s"]] * 3, by_figure


def test_the_scale_bench_prices_a_watchdog_connection_at_the_store_beside_a_torch_clients(
    scale_env: None,
) -> None:
    """The watchdog's own connection comes after init()'s burst, so the jobs' store CPU until
    ready leaves it out: it is priced apart, per connection opened and closed, against a torch
    client's, on the store server thread's own clock."""
    import bench_scale

    found = bench_scale.connection_cost(50, 2)
    assert sorted(found) == sorted([bench_scale.CONNECT_DDPKIT, bench_scale.CONNECT_PLAIN])
    for variant, trials in found.items():
        assert len(trials) == 2 and all(0 < us < 10_000 for us in trials), (variant, trials)


def test_a_scale_bench_whose_lookups_are_slow_runs_again_with_a_hosts_file_of_its_own(
    tmp_path: Path,
) -> None:
    """torch's client names ::ffff:127.0.0.1 when a process first connects; where the resolver
    is slow the scale benches run themselves again in a mount namespace whose /etc/hosts copy
    holds that address. Forced here (every lookup counted slow): the re-run sees the line, the
    real file is untouched, the copy is gone, and the re-run, still "slow", says so instead of
    looping."""
    import subprocess

    from tests.support.resolver import private_files_or_skip

    private_files_or_skip()
    script = tmp_path / "bench.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(BENCH)!r})\nimport scalesim\n"
        "scalesim.SLOW_LOOKUP_S = -1.0\nprint(scalesim.resolver_answers())\n"
        "print('hosts:', open('/etc/hosts').read().splitlines()[-1])\n"
    )
    before = Path("/etc/hosts").read_text()
    leftovers = set(Path("/tmp").glob("ddpkit-bench-hosts-*"))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    first, hosts = done.stdout.splitlines()[-2:]
    assert first.startswith("resolver: WARNING: 64 lookups of ::ffff:127.0.0.1 at once took")
    assert hosts == "hosts: ::ffff:127.0.0.1 localhost"
    assert Path("/etc/hosts").read_text() == before
    assert set(Path("/tmp").glob("ddpkit-bench-hosts-*")) == leftovers


def test_the_watchdog_burst_is_the_busiest_slot_of_the_window_over_its_mean(
    scale_env: None,
) -> None:
    import bench_scale
    import scalesim

    slot = scalesim.SLOT_S
    # two processes' tallies; the window holds slots 10..13 (slot 9 and 14 lie outside it)
    even = [{9: 50, 10: 2, 11: 2}, {12: 2, 13: 2, 14: 50}]
    assert bench_scale.peak_over_mean(even, 10 * slot, 14 * slot) == 1.0
    bunched = [{10: 8}, {10: 4, 12: 4}]
    assert bench_scale.peak_over_mean(bunched, 10 * slot, 14 * slot) == 12 * 4 / 16
    assert bench_scale.peak_over_mean([{}], 10 * slot, 14 * slot) == 0.0


def test_the_judging_round_times_ddpkits_watchdog_and_the_plain_way_on_one_store(
    scale_env: None,
) -> None:
    import bench_scale

    found = bench_scale.judging_round([1024, 2500], 2)
    assert set(found) == {bench_scale.JUDGE_DDPKIT, bench_scale.JUDGE_PLAIN}
    for by_n in found.values():
        assert set(by_n) == {1024, 2500}
        assert all(len(trials) == 2 and min(trials) > 0 for trials in by_n.values())


def test_listen_overflows_counts_the_connects_a_full_queue_drops(scale_env: None) -> None:
    """The scale bench's overflow figure reads the kernel's own counter: a listen queue of one
    that nobody accepts from, ten connects, some dropped."""
    import scalesim

    before = scalesim.listen_overflows()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        clients = [socket.socket() for _ in range(10)]
        try:
            for client in clients:
                client.setblocking(False)
                client.connect_ex(listener.getsockname())
            time.sleep(0.5)
            assert scalesim.listen_overflows() - before >= 1
        finally:
            for client in clients:
                client.close()


def test_the_phase_diagnostic_gives_each_steps_time_and_its_threads_cpu(
    scale_env: None,
) -> None:
    """scale_phases.py: per step of a simulated rank's start-up, when the last rank finished
    it and the CPU the thread that did it spent (the watchdog link's steps for ddpkit only)."""
    import scale_phases

    ours = scale_phases.job(8, 2, "ddpkit")
    plain = scale_phases.job(8, 2, "plain")
    last = ours["last_at_s"]
    # each watchdog's own connection is made in init(), before it returns (the order of one
    # rank's stamps, so of the last rank's too)
    assert last["connected"] <= last["formed"] <= last["linked"], last
    assert last["linked"] <= last["cloned"] <= last["ready"], last
    steps = ["start->connected", "connected->formed", "formed->ready"]
    assert sorted(ours["thread_cpu_ms"]) == sorted([*steps, "linked->cloned"])
    assert sorted(plain["thread_cpu_ms"]) == sorted(steps)
    for found in (ours, plain):
        for step, cpu in found["thread_cpu_ms"].items():
            assert 0 <= cpu["p50"] < 1000 and 0 <= cpu["mean"] < 1000, (step, cpu)
    # each rank's connect and its watchdog's clone cost its thread some CPU
    assert ours["thread_cpu_ms"]["start->connected"]["mean"] > 0
    assert ours["thread_cpu_ms"]["linked->cloned"]["mean"] > 0


def test_the_verdict_wait_diagnostic_times_the_store_over_the_window_for_both_ways(
    scale_env: None,
) -> None:
    """verdict_wait.py: 7 ranks waiting for rank 0's verdict, ddpkit's wait and the old poll,
    each the store host's CPU over the window and when the last rank had the verdict."""
    import verdict_wait

    for how in ("wait", "poll"):
        found = verdict_wait.run(8, how, 0.5)
        assert (found["N"], found["how"], found["window_s"]) == (8, how, 0.5)
        assert 0 < found["store_cpu_s"] < 60 and found["store_busy"] >= 0, found
        assert -0.5 < found["last_had_it_s"] < 60, found  # every rank got it, after it was set


def test_every_bench_takes_the_reports_json_and_quick_options() -> None:
    """report.py runs every bench_*.py with ``--json FILE`` (and ``--quick``): a bench that
    does not take them fails the report (bench_fsdp_memory and bench_exit once did)."""
    missing = [
        path.name
        for path in sorted(BENCH.glob("bench_*.py"))
        if not all(option in path.read_text() for option in ('"--json"', '"--quick"'))
        and "benchjson.add_arguments(parser)" not in path.read_text()
    ]
    assert missing == []
