"""Processes described by torch's ``env://`` variables alone: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT (Kubeflow's PyTorchJob v1 with one process per pod, ``mp.spawn`` recipes that
export them, job scripts that export them by hand).

Detected when RANK or WORLD_SIZE is set, or LOCAL_RANK / LOCAL_WORLD_SIZE say the process is
not alone on its host, and no launcher earlier in the detection order recognised it: a partial
set is never a silent world of one but a job of WORLD_SIZE processes, or a one-line error
naming the variables set and those missing. MASTER_ADDR / MASTER_PORT alone, or LOCAL_RANK=0 /
LOCAL_WORLD_SIZE=1, are what a shell may carry over to a process started on its own: that
stays a world of one.

Where each process sits on its host:

* LOCAL_WORLD_SIZE set: that many processes share each host, placed by rank in blocks as
  torchrun places them: local rank LOCAL_RANK, else RANK % LOCAL_WORLD_SIZE; node RANK //
  LOCAL_WORLD_SIZE.
* both unset: one process a host (Kubeflow's pods): local rank 0 of 1, node RANK of
  WORLD_SIZE; should several share a host after all, ``ddpkit.init``'s GPU check stops them.
* LOCAL_RANK without LOCAL_WORLD_SIZE (in a world of more than one): an error, since it says
  several processes may share the host without saying how many.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ddpkit.cluster import validate
from ddpkit.cluster.environments.base import ClusterEnvironment
from ddpkit.cluster.envvars import env_int, master_from_env
from ddpkit.cluster.rankinfo import ANY_PORT, Launcher, RankInfo
from ddpkit.errors import ConfigError
from ddpkit.masking import assignment

__all__ = ["ENV_METHOD_VARS", "TorchEnvEnvironment"]

# What torch's env:// reads, in its order; the two that say "a job of several processes".
ENV_METHOD_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_WORLD_VARS = ("RANK", "WORLD_SIZE")
_LOCAL_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")
# What each field was read from under the one-process-per-host rule.
_ONE_PER_HOST_NAMES = {
    "rank": "RANK",
    "world_size": "WORLD_SIZE",
    "local_rank": "LOCAL_RANK",
    "local_world_size": "1 (one process per host: LOCAL_WORLD_SIZE unset)",
    "node_rank": "RANK",
    "num_nodes": "WORLD_SIZE",
}
_HINT = (
    "export RANK, WORLD_SIZE, MASTER_ADDR (host of rank 0) and MASTER_PORT (a free port) in "
    "every process, as torch's env:// needs (LOCAL_WORLD_SIZE too when several share a host), "
    "or start the job with torchrun / ddpkit run, which set them all"
)


class TorchEnvEnvironment(ClusterEnvironment):
    """Detected by RANK, WORLD_SIZE or a LOCAL_* of several processes; after every launcher
    with variables of its own."""

    launcher: ClassVar[Launcher] = "env"
    _VARS: ClassVar[dict[str, str]] = {
        "rank": "RANK",
        "world_size": "WORLD_SIZE",
        "local_rank": "LOCAL_RANK",
        "local_world_size": "LOCAL_WORLD_SIZE",
        "node_rank": "RANK // LOCAL_WORLD_SIZE",
        "num_nodes": "ceil(WORLD_SIZE / LOCAL_WORLD_SIZE)",
    }

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return any(name in env for name in _WORLD_VARS) or _not_alone(env)

    def rank_info(self) -> RankInfo:
        env = self.env
        world_size = env_int(env, "WORLD_SIZE", hint=_HINT)
        if world_size is None:
            missing = [name for name in _WORLD_VARS if name not in env]
            raise _incomplete(env, missing, "torch's env:// needs it")
        validate.check_sizes(names=self._VARS, world_size=world_size)
        rank = env_int(env, "RANK", hint=_HINT)
        if rank is None and world_size > 1:
            raise _incomplete(env, ["RANK"], "torch's env:// needs it")
        addr, port = _master(env, world_size)
        rank = 0 if rank is None else rank
        local_rank, local_world_size, node_rank, num_nodes = _placement(env, rank, world_size)
        info = RankInfo(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=addr,
            master_port=port,
            launcher=self.launcher,
        )
        names = self._VARS if "LOCAL_WORLD_SIZE" in env else _ONE_PER_HOST_NAMES
        return validate.check_rank_info(info, names)


def _not_alone(env: Mapping[str, str]) -> bool:
    """LOCAL_RANK or LOCAL_WORLD_SIZE set to anything a process alone would not have (a local
    rank other than 0, more than one process on the host, or a value that is no number)."""
    return env.get("LOCAL_RANK", "0").strip() != "0" or (
        env.get("LOCAL_WORLD_SIZE", "1").strip() != "1"
    )


def _placement(env: Mapping[str, str], rank: int, world_size: int) -> tuple[int, int, int, int]:
    """(local rank, local world size, node rank, number of nodes) by the module's rule."""
    local_rank = env_int(env, "LOCAL_RANK", hint=_HINT)
    local_world_size = env_int(env, "LOCAL_WORLD_SIZE", hint=_HINT)
    if local_world_size is None:
        if local_rank is not None and world_size > 1:
            raise _incomplete(
                env,
                ["LOCAL_WORLD_SIZE"],
                "LOCAL_RANK says several processes may share this host but not how many",
                hint="export LOCAL_WORLD_SIZE=<processes on each host> too, or unset LOCAL_RANK "
                "when each host runs one process",
            )
        local_world_size, node_rank, num_nodes = 1, rank, world_size
    else:
        validate.check_sizes(
            names={"local_world_size": "LOCAL_WORLD_SIZE"}, local_world_size=local_world_size
        )
        node_rank = rank // local_world_size
        num_nodes = -(-world_size // local_world_size)  # ceil without floats
    if local_rank is None:
        local_rank = rank % local_world_size
    return local_rank, local_world_size, node_rank, num_nodes


def _master(env: Mapping[str, str], world_size: int) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, required for a world of more than one (a world of one
    never contacts a master: loopback, and any port)."""
    addr, port = master_from_env(env)
    if world_size == 1:
        return addr or "127.0.0.1", ANY_PORT if port is None else port
    if addr is None or port is None:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
        raise _incomplete(env, missing, "torch's env:// needs them for a world of more than one")
    return addr, port


def _incomplete(
    env: Mapping[str, str], missing: list[str], why: str, hint: str = _HINT
) -> ConfigError:
    shown = ", ".join(
        assignment(name, env[name]) for name in (*ENV_METHOD_VARS, *_LOCAL_VARS) if name in env
    )
    return ConfigError(f"{shown} set but not {', '.join(missing)}: {why}", hint=hint)
