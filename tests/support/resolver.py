"""A resolver that never answers, for tests that must meet one: a nameserver that reads every
query and never answers, and a command that runs in a mount namespace of its own whose
``/etc/resolv.conf`` (and ``/etc/hosts``) are the test's files. Needs root, ``unshare`` and
``mount``: a test without them fails under ``CI=true`` and is skipped (saying why) elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.needs import missing

__all__ = [
    "private_files_or_skip",
    "silent_nameserver",
    "system_hosts",
    "with_files",
    "with_mapped_loopback",
]


def private_files_or_skip() -> None:
    lacking = [tool for tool in ("unshare", "mount") if shutil.which(tool) is None]
    lacking += [] if os.geteuid() == 0 else ["root"]
    if lacking:
        missing(f"needs {', '.join(lacking)}: a resolv.conf and hosts file of the test's own")


@contextlib.contextmanager
def silent_nameserver(first: int) -> Iterator[str]:
    """Port 53 (resolv.conf names no port) of a loopback address of its own, 127.53.N.1 from
    N = ``first`` on (tests running side by side take different ranges)."""
    for third in range(first, first + 50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
            try:
                silent.bind((f"127.53.{third}.1", 53))
            except OSError:
                continue
            yield f"127.53.{third}.1"
            return
    pytest.fail("no loopback address had port 53 free for a silent nameserver")


def system_hosts() -> Path:
    """The machine's own hosts file: ci/test.sh runs the tests where /etc/hosts is a copy that
    names ::ffff:127.0.0.1 (this machine's resolver drops some lookups of it) and says where the
    machine's is (``DDPKIT_TEST_SYSTEM_HOSTS``); a test of a slow resolver starts from that."""
    return Path(os.environ.get("DDPKIT_TEST_SYSTEM_HOSTS") or "/etc/hosts")


def with_mapped_loopback(folder: Path) -> Path:
    """A copy of the machine's hosts file with the line ``ddpkit doctor`` and ``ddpkit.init``
    name."""
    hosts = folder / "hosts"
    line = f"::ffff:127.0.0.1 {socket.gethostname()}"
    hosts.write_text(system_hosts().read_text() + f"\n{line}\n")
    return hosts


def with_files(resolv: Path, hosts: Path, command: list[str]) -> list[str]:
    """``command`` run where /etc/resolv.conf is ``resolv`` and /etc/hosts is ``hosts``."""
    mounts = 'mount --bind "$0" /etc/resolv.conf && mount --bind "$1" /etc/hosts && shift'
    mounts += ' && exec "$@"'
    sh = ["sh", "-c", mounts, str(resolv), str(hosts)]
    return ["unshare", "--mount", "--propagation", "private", *sh, *command]
