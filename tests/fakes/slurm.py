"""The one SLURM fake of the test suite: every test that fakes SLURM uses this module.

Two seams, two fakes:

* :class:`FakeSlurm`, a ``Runner`` (the seam of ``ddpkit.cluster.slurmtools``) answering
  per tool the way SLURM 22.05 does (texts copied from the real tools, e.g. a cluster without
  accounting, where sacct fails) and recording every call;
* :class:`FakeTools`, SLURM's command-line clients as small shell scripts in a folder put
  first on PATH, for code that runs the real commands (the CLI in a subprocess, a rendered
  batch script under bash, a worker calling ``scontrol requeue``): a recording ``sbatch``,
  ``scontrol`` answering ``show job`` / ``show config`` / ``requeue``, a no-op ``srun``, and
  stubs that record their argv, environment and working directory.

The real cluster (``ci/slurm-up``) is tests/support/slurm_cluster.py's ``slurm`` fixture,
used only by files named ``*_cluster.py`` (tests/test_architecture.py checks it).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from ddpkit.cluster.slurmtools import CommandResult

__all__ = [
    "INVALID_ID",
    "NO_ACCOUNTING",
    "OK",
    "RECORDER",
    "Answer",
    "FakeSlurm",
    "FakeTools",
    "scontrol_line",
]

# ------------------------------------------------------------------ the Runner seam

NO_ACCOUNTING = "Slurm accounting storage is disabled\n"
INVALID_ID = "slurm_load_jobs error: Invalid job id specified\n"
OK = CommandResult(0, "", "")

Answer = CommandResult | Callable[[Sequence[str], str | None], CommandResult]


class FakeSlurm:
    """A Runner answering per tool (argv[0]), recording every call; other tools fail the test."""

    def __init__(self, **answers: Answer) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], str | None]] = []

    def __call__(
        self, argv: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        self.calls.append((list(argv), stdin))
        answer = self.answers.get(argv[0])
        if answer is None:
            pytest.fail(f"unexpected command {shlex.join(argv)}")
        return answer(argv, stdin) if callable(answer) else answer

    def tools(self) -> list[str]:
        return [argv[0] for argv, _ in self.calls]


def scontrol_line(job: str, state: str, exit_code: str = "0:0", extra: str = "") -> str:
    """One `scontrol show job --oneliner` line as SLURM 22.05 prints it (values with spaces too)."""
    return (
        f"JobId={job} JobName=my job name UserId=root(0) GroupId=root(0) {extra}Priority=1 "
        f"JobState={state} Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
        f"ExitCode={exit_code} RunTime=00:00:02 WorkDir=/tmp/a dir StdOut=/tmp/a dir/o.out\n"
    )


# ------------------------------------------------------------------ the tools on PATH

JOB_ID = "4242"

_SBATCH = """#!/bin/sh
# records its arguments and the script (stdin), then answers like `sbatch --parsable`
printf '%s\\n' "$@" > "{calls}/sbatch.args"
cat > "{calls}/sbatch.stdin"
if [ -n "$FAKE_SBATCH_FAIL" ]; then echo "sbatch: error: $FAKE_SBATCH_FAIL" >&2; exit 1; fi
echo {job_id}
"""
_SCONTROL_JOBS = """#!/bin/sh
# `scontrol show job`: knows no job, or the one line in $FAKE_SCONTROL_JOB
if [ -n "$FAKE_SCONTROL_JOB" ]; then echo "$FAKE_SCONTROL_JOB"; exit 0; fi
echo "slurm_load_jobs error: Invalid job id specified" >&2
exit 1
"""
# records argv, environment and cwd of one call, NUL-separated, under $RECORD_DIR
RECORDER = """#!/bin/bash
d="$RECORD_DIR/$(basename "$0").$$"
mkdir -p "$d"
printf '%s\\0' "$@" > "$d/argv"
env -0 > "$d/env"
printf '%s' "$PWD" > "$d/cwd"
"""


class FakeTools:
    """SLURM's clients as shell scripts in ``bin`` (put it first on PATH: :meth:`path`); the
    ones that record leave what they got in ``calls`` (default: ``bin`` itself)."""

    def __init__(self, bin_dir: Path, calls: Path | None = None) -> None:
        self.bin = bin_dir
        self.calls = bin_dir if calls is None else calls
        self.bin.mkdir(parents=True, exist_ok=True)
        self.calls.mkdir(parents=True, exist_ok=True)

    def install(self, name: str, text: str) -> Path:
        """An executable ``bin/name`` with ``text``."""
        tool = self.bin / name
        tool.write_text(text, encoding="utf-8")
        tool.chmod(0o755)
        return tool

    def sbatch(self, job_id: str = JOB_ID) -> Path:
        """Keeps its arguments (``calls/sbatch.args``) and script (``calls/sbatch.stdin``),
        prints ``job_id``; with ``FAKE_SBATCH_FAIL`` set, fails with that message instead."""
        return self.install("sbatch", _SBATCH.format(calls=self.calls, job_id=job_id))

    def submitted(self) -> bool:
        """Whether the fake ``sbatch`` was given a script."""
        return (self.calls / "sbatch.stdin").exists()

    def scontrol_jobs(self) -> Path:
        """``scontrol show job``: no job known, or the line in ``FAKE_SCONTROL_JOB``."""
        return self.install("scontrol", _SCONTROL_JOBS)

    def scontrol_config(self, text: str) -> Path:
        """``scontrol show config`` (any arguments) printing ``text``."""
        return self.install("scontrol", f"#!/bin/sh\nprintf '%s' {shlex.quote(text)}\n")

    def scontrol_exits(self, code: int) -> Path:
        """``scontrol`` (``requeue``) appending its arguments to ``calls/scontrol.args`` and
        exiting with ``code``, complaining as SLURM does when ``code`` is not 0."""
        complaint = 'echo "scontrol: error: Invalid job id specified for $2" >&2\n' if code else ""
        args = self.calls / "scontrol.args"
        return self.install(
            "scontrol", f'#!/bin/sh\necho "$@" >> "{args}"\n{complaint}exit {code}\n'
        )

    def scontrol_calls(self) -> list[str] | None:
        """The argument lines :meth:`scontrol_exits`'s scontrol got; None when never called."""
        args = self.calls / "scontrol.args"
        return args.read_text(encoding="utf-8").splitlines() if args.exists() else None

    def srun(self) -> Path:
        """An ``srun`` that does nothing (submitit renders its script only where srun is)."""
        return self.install("srun", "#!/bin/sh\nexit 0\n")

    def recorders(self, *names: str) -> None:
        """Each of ``names`` records its argv, environment and cwd under ``$RECORD_DIR``."""
        for name in names:
            self.install(name, RECORDER)

    def path(self, base: str | None = None) -> str:
        """PATH with ``bin`` first (``base``: the rest, default this process's PATH)."""
        return f"{self.bin}{os.pathsep}{os.environ['PATH'] if base is None else base}"
