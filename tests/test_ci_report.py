"""ci/slowest.py's report of the SLURM jobs' own CPU (``--jobs``): sacct's lines, read as
ci/test.sh takes them (``sacct -a --duplicates -n -P -o JobID,JobName,TotalCPU,WorkDir``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _slowest() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_slowest", ROOT / "ci" / "slowest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:07.690", 7.69), ("01:14.983", 74.983), ("1:02:03", 3723.0), ("2-00:00:01", 172801.0)],
)
def test_totalcpu_in_every_form_sacct_prints(text: str, seconds: float) -> None:
    assert _slowest()._seconds(text) == pytest.approx(seconds)


def test_jobs_are_summed_by_their_test_folder_once_each_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = "/tmp/pytest-of-root/pytest-7/popen-gw1"
    (tmp_path / "sacct.txt").write_text(
        # a requeued job: two runs (--duplicates), each with the steps its line already sums
        f"5|scale|00:07.000|{base}/test_four_nodes0\n"
        f"5.batch|batch|00:00.500|{base}/test_four_nodes0\n"
        f"5.0|python3|00:06.500|{base}/test_four_nodes0\n"
        f"5|scale|01:00.000|{base}/test_four_nodes0\n"
        # a module fixture's folder, below it the job's own
        f"6|pre-srun|00:20.000|{base}/srun0/logs\n"
        # not under xdist: the job's name stands for its folder; a line cut short is skipped
        "7|doctor|00:03.000|/somewhere/else\n"
        "8|cut\n"
    )
    _slowest()._jobs(tmp_path / "sacct.txt", top=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== the SLURM jobs: 4 runs, 90 CPU-s (sacct TotalCPU, a floor)", out
    assert out[2].split() == ["67", "2", "test_four_nodes0"], out
    assert out[3].split() == ["20", "1", "srun0"], out
    assert len(out) == 4, out  # top=2


def test_no_sacct_lines_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _slowest()._jobs(tmp_path / "missing.txt", top=5)
    assert "no SLURM job lines" in capsys.readouterr().out
