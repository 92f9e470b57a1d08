"""Hostile or broken input to ``ddpkit plan|submit``: one line, exit 2, bounded memory and time.

Every case runs the real command in a child whose address space is limited (RLIMIT_AS, a few
hundred MB: far more than a plan needs, far less than what the input would make ddpkit take)
under a wall-clock timeout, so that input that would eat the machine fails the test with a
MemoryError or a timeout instead. Each must end with exit code 2, nothing on stdout, a single
short stderr line naming the file (or --set/--sweep) and the field where there is one, with a
hint, no traceback, and nothing handed to sbatch (a fake one that records a call).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.slurm import FakeTools

MEMORY_LIMIT = 400 * 2**20  # bytes of address space for the child: python + ddpkit need ~150
TIME_LIMIT_S = 60  # a plan takes about a second; this is for a loaded 2-core CI box
MAX_ERROR_CHARS = 1500
BASE = "name: demo\ncommand: train.py\n"


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def alias_bomb(levels: int) -> str:
    """``nodes:`` as a billion-laughs list: 9 ** (levels + 1) strings from ~45 bytes a level."""
    lines = ["nodes:", ' - &l0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f" - &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return BASE + "\n".join(lines) + "\n"


def flow_bomb(levels: int) -> str:
    """The same in one flow value, as ``--set nodes=...`` would give it."""
    items = ["&l0 [x,x,x,x,x,x,x,x,x]"]
    items += [f"&l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "[" + ", ".join(items) + "]"


def run_ddpkit(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    tools = FakeTools(tmp_path / "bin")
    tools.sbatch()
    env = {
        **os.environ,
        "PATH": tools.path(),
        "DDPKIT_HOME": str(tmp_path / "home"),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ddpkit", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIME_LIMIT_S,
            preexec_fn=_limit_memory,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"ddpkit {' '.join(a[:60] for a in args)} ran past {TIME_LIMIT_S} s")
    return done.returncode, done.stdout, done.stderr


def assert_one_line_error(tmp_path: Path, result: tuple[int, str, str], *expected: str) -> None:
    code, out, err = result
    assert "Traceback" not in err and "MemoryError" not in err, err[-2000:]
    assert len(err) <= MAX_ERROR_CHARS, f"{len(err)} characters: {err[:300]}...{err[-300:]}"
    assert (code, out) == (2, ""), err
    assert err.startswith("ddpkit: error: ") and err.count("\n") == 1, err
    assert "(hint: " in err, err
    for part in expected:
        assert part in err, err
    assert not FakeTools(tmp_path / "bin").submitted(), "sbatch was called"
    assert not (tmp_path / "home").exists(), "a job record was written"


# (id, spec text, what the error line must say besides the file name)
FILE_CASES = [
    ("alias-bomb", alias_bomb(6), ["line 9, column", "more than 100000 values"]),
    ("bigger-alias-bomb", alias_bomb(9), ["more than 100000 values"]),
    (
        "alias-bomb-in-env",
        BASE
        + "x: &a [a, a, a, a, a, a, a, a, a, a]\n"
        + "".join(
            f"y{i}: &a{i} [" + ", ".join(["*a" if i == 0 else f"*a{i - 1}"] * 10) + "]\n"
            for i in range(8)
        ),
        ["more than 100000 values"],
    ),
    ("nodes-30M", BASE + "nodes: 30000000\n", ["nodes=30000000", "more than 100000"]),
    ("procs-huge", BASE + "nodes: 1000\nprocs_per_node: 10000000\n", ["procs_per_node="]),
    ("time-huge", BASE + "time_min: 99999999999999999999\n", ["time_min=", "more than"]),
    ("list-key", BASE + "? [a, b]\n: 1\n", ["line 3, column 3", "a list is used as a mapping key"]),
    ("list-key-in-env", BASE + "env:\n  ? [a, b]\n  : 1\n", ["line 4", "mapping key"]),
    ("set-key", BASE + "env:\n  ? !!set {a}\n  : 1\n", ["line 4", "mapping key"]),
    ("deep-list", BASE + "nodes: " + "[" * 10000 + "]" * 10000 + "\n", ["nested more than"]),
    ("deep-map", BASE + "env: " + "{a: " * 10000 + "1" + "}" * 10000 + "\n", ["nested more"]),
    ("long-number", BASE + "nodes: 1" + "0" * 5000 + "\n", ["line 3", "cannot read this int"]),
    ("bad-date", BASE + "python: 2024-13-45\n", ["line 3", "cannot read this timestamp"]),
    ("bad-float-tag", BASE + "mem_gb: !!float abc\n", ["line 3", "cannot read this float"]),
    ("self-alias", BASE + "setup: &s [*s]\n", ["line 3", "inside the node it names"]),
    ("superscript-nodes", BASE + "nodes: ²\n", ["nodes='²'", "is not a whole number"]),
    ("fullwidth-procs", BASE + "procs_per_node: ４\n", ["procs_per_node='４'"]),
    ("arabic-indic-time", BASE + "time_min: ٣٠\n", ["time_min='٣٠'"]),
    ("long-bad-name", BASE.replace("demo", "x" * 100_000 + "!"), ["name='xxxx", "..."]),
    ("huge-file", BASE + "#" + "x" * (2 * 2**20) + "\n", ["larger than 1 MiB"]),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES]
)
def test_bad_spec_file_through_plan(tmp_path: Path, text: str, expected: list[str]) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(text, encoding="utf-8")
    result = run_ddpkit(tmp_path, "plan", str(spec))
    assert_one_line_error(tmp_path, result, f"ddpkit: error: {spec}", *expected)


@pytest.mark.parametrize("case", ["alias-bomb", "nodes-30M", "deep-list", "list-key"])
@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "submit"])
def test_bad_spec_file_through_submit(tmp_path: Path, case: str, dry: bool) -> None:
    text, expected = next(c[1:] for c in FILE_CASES if c[0] == case)
    spec = tmp_path / "job.yaml"
    spec.write_text(text, encoding="utf-8")
    result = run_ddpkit(tmp_path, "submit", str(spec), *(["--dry-run"] if dry else []))
    assert_one_line_error(tmp_path, result, f"ddpkit: error: {spec}", *expected)


def test_a_spec_that_never_ends(tmp_path: Path) -> None:
    result = run_ddpkit(tmp_path, "plan", "/dev/zero")
    assert_one_line_error(tmp_path, result, "/dev/zero", "larger than 1 MiB")


# (id, command-line arguments after the spec, what the error line must say)
FLAG_CASES = [
    ("set-alias-bomb", ["--set", f"nodes={flow_bomb(7)}"], ["--set", "more than 100000 values"]),
    ("set-deep", ["--set", "nodes=" + "[" * 10000 + "]" * 10000], ["--set", "nested more than"]),
    ("set-long-number", ["--set", "nodes=1" + "0" * 5000], ["--set", "cannot read this int"]),
    ("set-list-key", ["--set", "env={? [a]: 1}"], ["--set", "mapping key"]),
    ("set-nodes-30M", ["--set", "nodes=30000000"], ["--set: nodes=30000000", "more than"]),
    ("set-superscript", ["--set", "nodes=²"], ["--set: nodes='²'", "is not a whole number"]),
    ("set-long-key", ["--set", "x" * 100_000 + "=1"], ["--set: unknown key 'xxx", "..."]),
    ("set-long-value", ["--set", "name=" + "y" * 100_000 + "!"], ["--set: name='yyy", "..."]),
    ("set-long-bad-item", ["--set", "z" * 100_000], ["--set 'zzz", "is not KEY=VALUE"]),
    ("sweep-repeats", ["--sweep", "lr=" + ",".join(["1"] * 60_000)], ["--sweep", "repeated"]),
    ("sweep-long-name", ["--sweep", "p" * 100_000 + "!=1,2"], ["--sweep", "not a parameter"]),
    (
        "sweep-too-many",
        [
            "--sweep",
            "a=" + ",".join(map(str, range(400))),
            "--sweep",
            "b=" + ",".join(map(str, range(400))),
        ],
        ["--sweep", "160000 runs"],
    ),
]


@pytest.mark.parametrize(
    ("args", "expected"), [c[1:] for c in FLAG_CASES], ids=[c[0] for c in FLAG_CASES]
)
def test_bad_flags_through_plan_and_submit(
    tmp_path: Path, args: list[str], expected: list[str]
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(BASE)
    for command in (["plan"], ["submit", "--dry-run"]):
        result = run_ddpkit(tmp_path, *command, str(spec), *args)
        assert_one_line_error(tmp_path, result, "ddpkit: error: ", *expected)


def test_the_largest_allowed_job_plans_in_bounded_memory(tmp_path: Path) -> None:
    """100000 nodes x 1024 processes: the plan shows the first and last ranks, not 10**8 rows."""
    spec = tmp_path / "job.yaml"
    spec.write_text(BASE + "nodes: 100000\nprocs_per_node: 1024\n")
    code, out, err = run_ddpkit(tmp_path, "plan", str(spec))
    assert (code, err) == (0, "")
    assert "world size 102400000" in out
    assert "... ranks 32-102399967 not shown (rank = node * 1024 + local_rank)\n" in out
    assert out.splitlines()[-1].split() == ["99999", "node99999", "1023", "102399999", "cpu"]
    assert len(out.splitlines()) < 200
    code, out, err = run_ddpkit(tmp_path, "submit", "--dry-run", str(spec))
    assert (code, err) == (0, "") and "#SBATCH --nodes=100000\n" in out
