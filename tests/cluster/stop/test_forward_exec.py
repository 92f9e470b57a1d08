"""A stop signal sent to a catching-only relay never kills a child that has not exec'd yet.

Between its fork and its exec a child runs the relay's image: under CPython's vfork it blocks
every signal and shows the relay's handlers in ``SigCgt``, then restores the default actions
and unblocks. The relay once read that as "catches it", sent it, and the child died of it as it
unblocked, before its program started (CI: ``ddpkit run``'s rank 1 "died of SIGUSR2" in a storm).
Real processes (tests/scripts/preexec_child.py holds a child in that window for 0.6 s), the
signal at four moments: before the fork, early and late in the window, once the child exec'd.
A child that never handles it ends normally; one that handles it gets it once it does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = str(ROOT / "tests" / "scripts" / "preexec_child.py")
MOMENTS = ("before", "early", "late", "exec")


def test_no_moment_of_a_childs_start_lets_the_relay_kill_it() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    runs = {
        (then, when): subprocess.Popen(
            [sys.executable, SCRIPT, then, when],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for then in ("plain", "catch")
        for when in MOMENTS
    }
    seen = {}
    for key, run in runs.items():
        out, err = run.communicate(timeout=60)
        seen[key] = (run.returncode, out.split(), err)
    want = {
        (then, when): (0, ["got" if then == "catch" else "none", "exit", "0"], "")
        for then, when in runs
    }
    assert seen == want
