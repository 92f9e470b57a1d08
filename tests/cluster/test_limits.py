"""The open-files rule and raising the soft limit, in child processes given low limits."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable

import pytest

from ddpkit.cluster.limits import OpenFiles, open_files_needed

_ASK = """
import json, resource, sys
from ddpkit.cluster.limits import raise_open_files
got = raise_open_files(int(sys.argv[1]))
now = resource.getrlimit(resource.RLIMIT_NOFILE)
print(json.dumps({"got": [got.need, got.before, got.soft, got.hard], "now": list(now)}))
"""


def limited(soft: int, hard: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return apply


def ask(need: int, soft: int, hard: int) -> dict[str, list[int]]:
    done = subprocess.run(
        [sys.executable, "-c", _ASK, str(need)],
        preexec_fn=limited(soft, hard),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer: dict[str, list[int]] = json.loads(done.stdout)
    return answer


def test_the_rule_grows_with_the_job_and_the_store_host_needs_two_a_rank_more() -> None:
    assert open_files_needed(2, hosts_store=False) == 1 + 2 + 256
    assert open_files_needed(2, hosts_store=True) == 1 + 2 + 256 + 4
    assert open_files_needed(512, hosts_store=True) == 511 + 2 + 256 + 1024  # > 1,024


@pytest.mark.parametrize(
    ("need", "soft", "hard", "after"),
    [
        (1800, 1024, 4096, 1800),  # raised to the need, not to the hard limit
        (1800, 1024, 1500, 1500),  # as far as the hard limit allows
        (300, 1024, 4096, 1024),  # enough already: left alone, never lowered
        (1024, 1024, 1024, 1024),
    ],
)
def test_the_soft_limit_is_raised_only_as_far_as_needed_and_allowed(
    need: int, soft: int, hard: int, after: int
) -> None:
    answer = ask(need, soft, hard)
    assert answer["now"] == [after, hard]
    assert answer["got"] == [need, soft, after, hard]


def test_a_short_limit_says_what_is_needed_and_how_to_raise_it() -> None:
    short = OpenFiles(need=1800, before=1024, soft=1500, hard=1500)
    assert short.short
    line = short.warning(512)
    assert "\n" not in line
    assert "ulimit -n is 1500" in line and "512 ranks need 1800" in line
    assert "hard limit 1500" in line and "ddpkit doctor" in line
    assert not OpenFiles(need=300, before=1024, soft=1024, hard=4096).short


def test_another_process_limits_are_read_or_none() -> None:
    from ddpkit.cluster.limits import open_files_of

    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (300, 4000)); "
        "print('set', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "set\n"
        assert open_files_of(child.pid) == (300, 4000)
    finally:
        child.communicate(timeout=60)  # reaped here: its pid is not reused before this line
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    mine = open_files_of(os.getpid())
    assert mine is not None and mine[0] == (2**31 if soft == resource.RLIM_INFINITY else soft)
    assert open_files_of(2**22 + 12345) is None  # above pid_max: no such process
