"""The test cluster for the SLURM benches: its environment, and waiting until it is idle."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

DEFAULT_ENV_FILE = os.environ.get("DDPKIT_TEST_SLURM_ENV", "/tmp/ddpkit-slurm/env.sh")


def cluster_env(env_file: Path) -> dict[str, str]:
    """os.environ plus the ``export K=V`` lines of the cluster's env file (SLURM_CONF)."""
    if not env_file.is_file():
        raise SystemExit(f"no {env_file}: start the test cluster with ci/slurm-up first")
    env = dict(os.environ)
    for line in env_file.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, _, value = words[1].partition("=")
            env[key] = value
    return env


def wait_idle(env: dict[str, str], settle_s: float) -> None:
    """Until every node is idle (the last jobs' cleanup done), then a pause for the scheduler."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = subprocess.run(
            ["sinfo", "--noheader", "--Node", "--format", "%T"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if states and all(state == "idle" for state in states):
            time.sleep(settle_s)
            return
        time.sleep(0.05)
    raise SystemExit("the cluster's nodes did not become idle within 60 s")
