"""Rendezvous ports: a deterministic port per SLURM job/step, and a free port for one process.

``port_for_job`` gives every rank of a job the same port without talking to anyone, and jobs
sharing a node different ones: the ids go through a cryptographic hash (``job_id % 1000``
schemes alias neighbouring ids: pytorch#126510, Lightning#18466), into 10000-32767: above most
registered service ports, below Linux's default ephemeral range.

A derived port can still be taken, so a SLURM step searches a :class:`PortSearch`: the port
SLURM reserved for the step (``SLURM_STEP_RESV_PORTS``), then a short deterministic sequence;
rank 0 hosts on the first that binds, the others accept the first whose store answers with
the search's identity (:mod:`ddpkit.worker.rendezvous.portsearch`).
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.cluster.envvars import number_hint, to_int
from ddpkit.errors import ConfigError

__all__ = [
    "CANDIDATE_COUNT",
    "PORT_RANGE_END",
    "PORT_RANGE_START",
    "RESV_PORTS_VAR",
    "PortSearch",
    "candidate_ports",
    "free_port",
    "port_for_job",
    "reserved_port",
    "step_search",
]

PORT_RANGE_START = 10000
PORT_RANGE_END = 32767  # inclusive; Linux's ephemeral range starts at 32768
RESV_PORTS_VAR = "SLURM_STEP_RESV_PORTS"
# Eight candidates: with k jobs on a node, all eight taken by others needs ~(k/22768)**8.
CANDIDATE_COUNT = 8


@dataclass(frozen=True)
class PortSearch:
    """Where rank 0 may host the rendezvous store, in order, and the identity it publishes:
    one run of one step (job, step, restart count), told apart from another job's or a stale one."""

    identity: str
    ports: tuple[int, ...]


def port_for_job(job_id: str, step_id: str | None = None) -> int:
    """A port in [PORT_RANGE_START, PORT_RANGE_END] derived from the job (and step) id, the same
    in every process and Python version (never the salted ``hash()``)."""
    return _derive(_key(job_id, step_id))


def _key(job_id: str, step_id: str | None) -> str:
    job = str(job_id).strip()
    if not job:
        raise ConfigError(
            f"job_id={job_id!r} is empty",
            hint="pass the scheduler's job id, e.g. the value of SLURM_JOB_ID",
        )
    step = "" if step_id is None else str(step_id).strip()
    return f"{job}\x1f{step}"  # the separator keeps ("12", "34") and ("123", "4") apart


def _derive(key: str) -> int:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    span = PORT_RANGE_END - PORT_RANGE_START + 1
    # 64 bits reduced modulo ~2**14.5: the modulo bias is below 2**-49, i.e. none in practice.
    return PORT_RANGE_START + int.from_bytes(digest, "big") % span


def candidate_ports(job_id: str, step_id: str | None = None) -> tuple[int, ...]:
    """:data:`CANDIDATE_COUNT` distinct ports for the job/step: ``port_for_job`` first, then
    ports derived from (job, step, k) for k = 1, 2, ... Every rank computes the same sequence
    alone."""
    key = _key(job_id, step_id)
    ports = [_derive(key)]
    k = 1
    while len(ports) < CANDIDATE_COUNT:
        port = _derive(f"{key}\x1f{k}")  # a third field: never equal to a (job, step) key
        if port not in ports:
            ports.append(port)
        k += 1
    return tuple(ports)


def reserved_port(env: Mapping[str, str]) -> int | None:
    """The first port SLURM reserved for this step (``12001``, ``12003-12004`` or a list), else
    None; None in a heterogeneous job, whose components need not share one reservation."""
    if "SLURM_HET_SIZE" in env:
        return None
    raw = env.get(RESV_PORTS_VAR)
    if raw is None or not raw.strip():
        return None
    port = to_int(raw.strip().split(",")[0].split("-")[0].strip())
    if port is None or not 1 <= port <= 65535:
        hint = "srun sets it (e.g. 12001 or 12003-12004) with --resv-ports; unset it if "
        raise ConfigError(
            f"{RESV_PORTS_VAR}={raw!r} is not a port, a range or a list of them",
            hint=number_hint(raw, hint + "something else wrote it"),
        )
    return port


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the kernel picks it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


def step_search(
    identity: str, job_id: str, step_id: str | None, env: Mapping[str, str]
) -> PortSearch:
    """The search of a SLURM step: its reserved port (if any), then the candidates of
    (``job_id``, ``step_id``). SLURM keeps a reserved port from other steps only, not from a
    program started outside srun: the candidates stay behind it."""
    derived = candidate_ports(job_id, step_id)
    reserved = reserved_port(env)
    ports = derived if reserved is None else (reserved, *(p for p in derived if p != reserved))
    return PortSearch(identity, ports)
