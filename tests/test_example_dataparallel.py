"""examples/dataparallel.py runs on a machine without GPUs and tells its story."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_dataparallel_example_runs_on_cpu() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "examples/dataparallel.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert "running as 'single'" in out  # dp without GPUs: one note
    balanced = re.search(r"balanced: loss ([0-9.]+) on 4 CPU devices, whole batch ([0-9.]+)", out)
    assert balanced, out
    assert abs(float(balanced[1]) - float(balanced[2])) < 1e-5  # 3/3/3/1, weighted
    assert "split model: parts on cpu kept" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: the benchmark measures")
def test_the_dp_benchmark_measures_nothing_without_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The benchmark's ``main()`` in this process (what it says and writes, not how it is
    launched, is the point): no interpreter of its own to import torch again."""
    report = tmp_path / "dp.json"
    spec = importlib.util.spec_from_file_location("bench_dp", ROOT / "benchmarks" / "bench_dp.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_dp.py", "--quick", "--json", str(report)])
    assert bench.main() == 0
    assert "no CUDA device here: measured nothing" in capsys.readouterr().out
    written = json.loads(report.read_text())
    assert written["bench"] == "dp" and written["rows"] == []
