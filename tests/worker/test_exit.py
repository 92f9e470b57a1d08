"""The one exit path: ddpkit's at-exit steps run in their fixed order from one handler, a failed
step does not skip the later ones, and an exit code a step asks for comes after them, with
stdout and stderr flushed."""

from __future__ import annotations

import subprocess
import sys

from tests.support.spawned import child_env

SCRIPT = """
import sys
from ddpkit.worker import exit as process_exit
def step(name, code=None, fail=False):
    def run():
        print(name, end=" ")  # no newline, no flush: the exit must flush it
        if fail:
            raise RuntimeError("broken")
        return code
    return run
# added in another order than they run (as init(), a save and a connect add them)
process_exit.add(process_exit.DESTROY, "destroy", step("destroy"))
process_exit.add(process_exit.SHARE, "share", step("share", code=int(sys.argv[1])))
process_exit.add(process_exit.MARKER, "marker", step("marker", fail=True))
print("end of script", end=" ")
"""


def _run(code: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(code)], env=child_env(), capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip


def test_the_steps_run_in_order_and_a_failed_one_skips_none() -> None:
    done = _run(0)
    assert done.stdout.split() == ["end", "of", "script", "marker", "share", "destroy"]
    assert "the exit step 'marker' failed (RuntimeError: broken)" in done.stderr
    assert done.returncode == 0, done.stderr


def test_an_exit_code_a_step_asks_for_comes_after_every_step_with_the_output_flushed() -> None:
    done = _run(3)
    assert done.returncode == 3, done.stderr
    assert done.stdout.split()[-2:] == ["share", "destroy"]  # all printed, flushed
