"""``python -m ddpkit.cluster.rendezvous.endpoint``: the c10d ``host:port`` of a SLURM job.

The torchrun-mode job script runs it once and hands the result to every node's ``ddpkit run
--rdzv-endpoint``: the job's first node (renamed by ``DDPKIT_HOST_TEMPLATE``), and a port
derived from the job id unless ``--port N``. Torch-free: it runs at every job start.

:func:`hosts_store` says which node hosts the c10d store: torch guesses it from this host's
names and addresses, which a host template defeats (then no node hosted it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from ddpkit.cluster.environments.slurm import apply_host_template
from ddpkit.cluster.envvars import parse_port, require_set
from ddpkit.cluster.nodelist import first_host
from ddpkit.cluster.rendezvous.ports import port_for_job
from ddpkit.errors import DdpkitError

__all__ = ["RDZV_STEP", "endpoint", "hosts_store", "main"]

# The "step" mixed into port_for_job: keeps the rendezvous port apart from the port ddpkit
# derives for the job's srun steps (MASTER_PORT), which uses the numeric step ids.
RDZV_STEP = "rdzv"
_NODELIST_VARS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
_JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_JOBID")
_HINT = (
    "run it inside a SLURM job, as the generated batch script does; elsewhere set {var} "
    "yourself (SLURM_JOB_NODELIST, and SLURM_JOB_ID or --port N)"
)


def _first_set(env: Mapping[str, str], names: Sequence[str]) -> tuple[str, str]:
    return require_set(env, names, hint=_HINT.format(var=names[0]))


def _first_node(env: Mapping[str, str]) -> str:
    source, nodelist = _first_set(env, _NODELIST_VARS)
    return first_host(nodelist, source=source)


def endpoint(env: Mapping[str, str], port: str = "auto") -> str:
    """``host:port`` of the job's rendezvous, from SLURM's variables in ``env``; pure.

    ``port`` is ``"auto"`` (derived from SLURM_JOB_ID) or a port number as text.
    """
    host = apply_host_template(env, _first_node(env))
    if port == "auto":
        number = port_for_job(_first_set(env, _JOB_ID_VARS)[1], RDZV_STEP)
    else:
        number = parse_port("--port", port)
    # An IPv6 address needs brackets before the port.
    return f"[{host}]:{number}" if ":" in host else f"{host}:{number}"


def hosts_store(env: Mapping[str, str], rdzv_host: str) -> bool | None:
    """Whether this node hosts the c10d store at ``rdzv_host`` (the host of the endpoint): True
    on the job's first node, False on the others, when it is :func:`endpoint`'s host; None
    (torch decides) otherwise."""
    node = env.get("SLURMD_NODENAME")
    if node is None or not any(name in env for name in _NODELIST_VARS):
        return None
    first = _first_node(env)
    if rdzv_host != apply_host_template(env, first):
        return None
    return node == first


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Print the endpoint; exit 2 with one line on stderr when the environment is unusable."""
    parser = argparse.ArgumentParser(
        prog="python -m ddpkit.cluster.rendezvous.endpoint",
        description="Print the c10d rendezvous host:port of this SLURM job (first node, "
        "DDPKIT_HOST_TEMPLATE applied; port derived from the job id unless given).",
    )
    parser.add_argument(
        "--port", default="auto", metavar="N|auto", help="rendezvous port (default: auto)"
    )
    args = parser.parse_args(argv)
    try:
        text = endpoint(os.environ if env is None else env, args.port)
    except DdpkitError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
