"""The cluster's configuration as ``scontrol show config`` prints it: one command, one parser.

Its readers: ``MaxArraySize`` (how many tasks a sweep's array may have, checked before a
submission) and ``MpiParams`` (whether steps can reserve a port: asked by a job script's shell
by the same rule, or by ``python -m ddpkit.cluster.rendezvous.resv_ports`` in scripts from
before 2026-11-27).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddpkit.cluster.slurmtools.runner import Runner, SlurmError, subprocess_runner

__all__ = ["has_port_range", "max_array_size", "parse_config", "show_config"]

# "Name                    = value" lines; the header and the trailing sections have no "="
_LINE = re.compile(r"^(\w+)\s*=\s*(.*?)\s*$")


def parse_config(text: str) -> dict[str, str]:
    """``{name: value}`` of ``scontrol show config`` text (names as SLURM spells them)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if match is not None:
            found.setdefault(match.group(1), match.group(2))
    return found


def show_config(
    *, runner: Runner = subprocess_runner, env: Mapping[str, str] | None = None
) -> dict[str, str] | None:
    """The cluster's configuration, or None when SLURM cannot tell (no tools, no controller)."""
    try:
        done = runner(["scontrol", "show", "config"], env=env)
    except SlurmError:
        return None
    return parse_config(done.stdout) if done.returncode == 0 else None


def max_array_size(config: Mapping[str, str] | None) -> int | None:
    """``MaxArraySize`` (array indices 0..MaxArraySize-1), or None when not known."""
    value = (config or {}).get("MaxArraySize", "")
    return int(value) if value.isdigit() else None


def has_port_range(config: Mapping[str, str] | None) -> bool:
    """Whether steps can reserve ports (``srun --resv-ports``): ``MpiParams=ports=A-B``."""
    params = {name.lower(): value for name, value in (config or {}).items()}
    return "ports=" in params.get("mpiparams", "").lower()
