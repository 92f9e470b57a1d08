"""Rendezvous ports: a deterministic port per SLURM job/step, and a free port for one process.

``port_for_job`` must give every rank of a job the same port without talking to anyone, and
give different jobs sharing a node different ports. Schemes seen in the wild (``job_id % 1000``,
the last four digits) alias jobs whose ids share their last digits (pytorch#126510,
Lightning#18466); here the ids go through a cryptographic hash, so neighbouring or
digit-sharing ids land on unrelated ports and collisions follow the birthday bound.

The range is 10000–32767: wide (22768 ports, so two random jobs on a node collide with
probability ~1/22768), above the well-known and most registered service ports, and below
Linux's default ephemeral range (``net.ipv4.ip_local_port_range`` = 32768–60999), where the
kernel hands out ports for outgoing connections that could otherwise already occupy ours.
"""

from __future__ import annotations

import hashlib
import socket

from ddpkit.errors import ConfigError

__all__ = ["PORT_RANGE_END", "PORT_RANGE_START", "free_port", "port_for_job"]

PORT_RANGE_START = 10000
PORT_RANGE_END = 32767  # inclusive; Linux's ephemeral range starts at 32768


def port_for_job(job_id: str, step_id: str | None = None) -> int:
    """A port in [PORT_RANGE_START, PORT_RANGE_END] derived from the job (and step) id.

    Deterministic across processes, machines and Python versions (never ``hash()``, which is
    salted per process). Passing the step id gives concurrent steps of one job different ports.
    """
    job = str(job_id).strip()
    if not job:
        raise ConfigError(
            f"job_id={job_id!r} is empty",
            hint="pass the scheduler's job id, e.g. the value of SLURM_JOB_ID",
        )
    step = "" if step_id is None else str(step_id).strip()
    # The separator keeps ("12", "34") and ("123", "4") apart.
    digest = hashlib.blake2b(f"{job}\x1f{step}".encode(), digest_size=8).digest()
    span = PORT_RANGE_END - PORT_RANGE_START + 1
    # 64 bits reduced modulo ~2**14.5: the modulo bias is below 2**-49, i.e. none in practice.
    return PORT_RANGE_START + int.from_bytes(digest, "big") % span


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the kernel picks it by binding port 0).

    Another process may take it before it is used; fine for a single process or a launcher
    that hands it to its children at once.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port
