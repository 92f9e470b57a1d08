"""Nodes the peer watchdog blamed, for the bad-node exclusion (:mod:`.exclude`).

When a rank stops sending heartbeats (killed, e.g. by the out-of-memory killer, or its node
died or froze: a node-local cause, unlike a rank that raised), the watchdog that names it
appends ``<node>\\t<why>`` (SLURM's node name of the silent rank) to
``<DDPKIT_LOG_DIR>/.ddpkit-blamed-<job id>``. After the job's step failed, the exclusion reads
and removes that file and blames its nodes beside those whose health check fails (same caps).
Only plain host names of the job's own nodes count, so a stray file can at most exclude nodes
of this job, within ``max_excluded_nodes``. Stdlib only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from ddpkit.contract import LOG_DIR_VAR

PREFIX = ".ddpkit-blamed-"
_NODE = re.compile(r"[A-Za-z0-9._-]{1,255}")
_JOB = re.compile(r"[0-9_]{1,64}")
_READ_LIMIT = 64 * 1024  # a blame file is a few lines; a bigger one is read this far


def blame_path(record_dir: str | os.PathLike[str], job_id: str) -> Path | None:
    """``<record_dir>/.ddpkit-blamed-<job id>``; None for a job id that is not SLURM's."""
    if not _JOB.fullmatch(job_id):
        return None
    return Path(record_dir) / f"{PREFIX}{job_id}"


def record_blame(env: Mapping[str, str], node: str, why: str) -> Path | None:
    """Append ``node`` and ``why`` to the job's blame file; the path, or None when this is no
    SLURM job with a log folder or the node name is not a plain one. Never raises."""
    folder, job_id = env.get(LOG_DIR_VAR, "").strip(), env.get("SLURM_JOB_ID", "").strip()
    path = blame_path(folder, job_id) if folder else None
    if path is None or not _NODE.fullmatch(node):
        return None
    line = f"{node}\t{' '.join(why.split())[:300]}\n"
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.write(descriptor, line.encode())  # one write: lines of several ranks never mix
        finally:
            os.close(descriptor)
    except OSError:
        return None
    return path


def take_blamed(record_dir: str | os.PathLike[str], job_id: str) -> dict[str, str]:
    """The blamed nodes (node -> why, first reason kept), and the file removed; {} if none."""
    path = blame_path(record_dir, job_id)
    if path is None:
        return {}
    try:
        with path.open("rb") as source:
            text = source.read(_READ_LIMIT).decode("utf-8", "replace")
        path.unlink()
    except OSError:
        return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        node, _, why = line.partition("\t")
        if _NODE.fullmatch(node) and node not in found:
            found[node] = why.strip() or "blamed by the watchdog"
    return found
