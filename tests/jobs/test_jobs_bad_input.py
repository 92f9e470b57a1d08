"""Hostile or broken input to ``ddpkit plan|submit``: one line, exit 2, bounded memory and time.

Each must end with exit code 2, nothing on stdout, a single short stderr line naming the file
(or --set/--sweep) and the field where there is one, with a hint, no traceback, and nothing
handed to sbatch (a fake one that records a call). Address space is limited (RLIMIT_AS, a few
hundred MB over what the process holds: far more than a plan needs, far less than what the
input would make ddpkit take), so that input that would eat the machine fails the test with a
MemoryError instead.

Each kind of input (a spec file through ``plan``, through ``submit`` and ``submit --dry-run``,
flags, a file that never ends, the largest allowed job) has cases that run the real
``python -m ddpkit`` in a child (:data:`IN_A_CHILD`), under a wall-clock timeout: the exit
code, the streams and the absence of a traceback as a user sees them. The other cases call the
command line's ``main()`` in the test process, with its soft address-space limit lowered for
the call (:func:`_bounded_memory`): the same parser, checks and error line, without an
interpreter's start (~0.6 s of CPU each, 55 of them).
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ddpkit.cli import main
from tests.fakes.slurm import FakeTools

MEMORY_LIMIT = 400 * 2**20  # bytes of address space for the child: python + ddpkit need ~150
TIME_LIMIT_S = 60  # a plan takes about a second; this is for a loaded 2-core CI box
MAX_ERROR_CHARS = 1500
BASE = "name: demo\ncommand: train.py\n"


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@contextlib.contextmanager
def _bounded_memory() -> Iterator[None]:
    """The test process's soft RLIMIT_AS at what it maps now plus :data:`MEMORY_LIMIT`, for the
    block (the hard limit is untouched, so the soft one goes back up after it)."""
    status = Path("/proc/self/status").read_text()
    found = re.search(r"^VmSize:\s+(\d+) kB$", status, re.MULTILINE)
    assert found, status
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = int(found.group(1)) * 1024 + MEMORY_LIMIT
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


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


Runner = Callable[..., tuple[int, str, str]]


@pytest.fixture
def in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Runner:
    """``run(*args)``: ``ddpkit *args`` by the command line's ``main()`` in this process, with
    what :func:`run_ddpkit` gives its child (the fake sbatch first on PATH, DDPKIT_HOME, the
    working directory) and bounded memory; (exit code, stdout, stderr). An exception other than
    the command line's own errors propagates: the test fails with its traceback."""
    tools = FakeTools(tmp_path / "bin")
    tools.sbatch()
    monkeypatch.setenv("PATH", tools.path())
    monkeypatch.setenv("DDPKIT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        with _bounded_memory():
            code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def runner(case: str, in_process: Runner) -> Runner:
    """The real ``python -m ddpkit`` for the cases in :data:`IN_A_CHILD`, else ``main()``."""
    if case in IN_A_CHILD:
        return run_ddpkit
    return lambda tmp_path, *args: in_process(*args)


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


# The cases run by the real ``python -m ddpkit`` in a child: of each kind, the one that would
# take the most memory or time if its bound were lost (the others call main() in this process).
IN_A_CHILD = {"bigger-alias-bomb", "submit-alias-bomb", "dry-run-nodes-30M", "set-alias-bomb"}


@pytest.mark.parametrize(("case", "text", "expected"), FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_spec_file_through_plan(
    tmp_path: Path, in_process: Runner, case: str, text: str, expected: list[str]
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(text, encoding="utf-8")
    result = runner(case, in_process)(tmp_path, "plan", str(spec))
    assert_one_line_error(tmp_path, result, f"ddpkit: error: {spec}", *expected)


SUBMIT_CASES = ["alias-bomb", "nodes-30M", "deep-list", "list-key"]


@pytest.mark.parametrize("case", SUBMIT_CASES)
@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "submit"])
def test_bad_spec_file_through_submit(
    tmp_path: Path, in_process: Runner, case: str, dry: bool
) -> None:
    text, expected = next(c[1:] for c in FILE_CASES if c[0] == case)
    spec = tmp_path / "job.yaml"
    spec.write_text(text, encoding="utf-8")
    run = runner(f"{'dry-run' if dry else 'submit'}-{case}", in_process)
    result = run(tmp_path, "submit", str(spec), *(["--dry-run"] if dry else []))
    assert_one_line_error(tmp_path, result, f"ddpkit: error: {spec}", *expected)


def test_each_case_in_a_child_is_a_case() -> None:
    """A misspelt name in IN_A_CHILD would leave its kind without a real process."""
    submit = {f"{how}-{case}" for how in ("dry-run", "submit") for case in SUBMIT_CASES}
    known = {c[0] for c in FILE_CASES} | {c[0] for c in FLAG_CASES} | submit
    assert known >= IN_A_CHILD


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


@pytest.mark.parametrize(("case", "args", "expected"), FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_bad_flags_through_plan_and_submit(
    tmp_path: Path, in_process: Runner, case: str, args: list[str], expected: list[str]
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(BASE)
    for command in (["plan"], ["submit", "--dry-run"]):
        result = runner(case, in_process)(tmp_path, *command, str(spec), *args)
        assert_one_line_error(tmp_path, result, "ddpkit: error: ", *expected)


def test_the_largest_allowed_job_plans_in_bounded_memory(
    tmp_path: Path, in_process: Runner
) -> None:
    """100000 nodes x 1024 processes: the plan shows the first and last ranks, not 10**8 rows
    (``plan`` in a child, ``submit --dry-run`` by main())."""
    spec = tmp_path / "job.yaml"
    spec.write_text(BASE + "nodes: 100000\nprocs_per_node: 1024\n")
    code, out, err = run_ddpkit(tmp_path, "plan", str(spec))
    assert (code, err) == (0, "")
    assert "world size 102400000" in out
    assert "... ranks 32-102399967 not shown (rank = node * 1024 + local_rank)\n" in out
    assert out.splitlines()[-1].split() == ["99999", "node99999", "1023", "102399999", "cpu"]
    assert len(out.splitlines()) < 200
    code, out, err = in_process("submit", "--dry-run", str(spec))
    assert (code, err) == (0, "") and "#SBATCH --nodes=100000\n" in out
