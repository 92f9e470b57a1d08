"""The local launcher behind ``ddpkit run``: a ``RunConfig`` run by torch's elastic agent.

``build_launch_config`` goes through torch's own parser, so every flag means what it means
under torchrun, then sets ddpkit's defaults (on several nodes, gloo's and NCCL's interface:
:func:`ifname_env`). ``launch`` runs ``elastic_launch`` with torch's
process-wide side effects (``os.environ``, signal handlers) undone afterwards, the signals
passed on (:mod:`.relay`), the workers tied to the launcher (:mod:`.deathsig`), and returns a
``LaunchOutcome`` (:mod:`.report`) instead of torch's ``ChildFailedError`` box.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed
import torch.distributed.run as torch_run
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.api import LogsDest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError as TorchRendezvousError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ddpkit.cluster.durations import scaled_bound
from ddpkit.cluster.limits import open_files_needed, raise_open_files
from ddpkit.cluster.rendezvous.endpoint import hosts_store
from ddpkit.cluster.rendezvous.ifname import IFNAME_VARS, job_interface, unset_vars
from ddpkit.cluster.rendezvous.interfaces import Interface, is_this_host, route_interface
from ddpkit.cluster.runid import launch_run_id
from ddpkit.cluster.stop import forward as stop_forward
from ddpkit.compat import (
    launch_config_from_args,
    rdzv_shared_store_made_by,
    tee_read_by,
    torchrun_notice_muted,
)
from ddpkit.contract import RUN_ID_VAR
from ddpkit.errors import ConfigError, RendezvousError
from ddpkit.launch import deathsig, node_order, rdzv_port, relay, tee
from ddpkit.launch.config import RunConfig
from ddpkit.launch.report import LaunchOutcome, attempt_dir, failed_outcome

__all__ = ["LaunchPlan", "build_launch_config", "ifname_env", "launch"]

STATIC_MASTER_PORT = 29500  # torch's run() default when --master-port is not given
_SHARED_RDZV_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@dataclass(frozen=True)
class LaunchPlan:
    """What ``launch`` hands to ``elastic_launch``; ``worker_env`` is set only while it runs."""

    launch_config: LaunchConfig
    entrypoint: str | Callable[..., Any]
    args: tuple[str, ...]
    worker_env: Mapping[str, str] = field(default_factory=dict)
    # the loopback address the workers' shared store listens on: a one-node run of one
    # round on a loopback rendezvous (None: each round's workers host a store of their own)
    shared_store_bind: str | None = None


HOST_MACRO = "${host}"


def with_host(template: str) -> str:
    """The prefix template with ddpkit's ``${host}`` macro replaced by this node's short host
    name (which node a line came from); torch's substitution leaves unknown macros alone."""
    return template.replace(HOST_MACRO, socket.gethostname().split(".")[0])


def build_launch_config(config: RunConfig) -> LaunchPlan:
    """Build torch's ``LaunchConfig`` with torch's own parser and ``config_from_args``, as the
    first lines of ``torch.distributed.run.run`` do (not called: it would add its ``@record``
    box). ``os.environ`` is left as it was: what torch sets for the workers is in ``worker_env``."""
    config = _store_host_decided(config, os.environ)
    if config.numa_binding is not None and importlib.util.find_spec("torch.numa") is None:
        raise ConfigError(
            f"--numa-binding={config.numa_binding} needs torch 2.9 or newer (this is torch "
            f"{torch.__version__})",
            hint="upgrade torch, or bind with srun (a job spec's cpu_bind)",
        )
    args = torch_run.get_args_parser().parse_args(config.torchrun_argv())  # = parse_args
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = STATIC_MASTER_PORT
    with _environ_restored() as before, torchrun_notice_muted():
        try:
            launch_config, entrypoint, cmd_args = launch_config_from_args(args)
        except (ValueError, AssertionError, RuntimeError) as exc:
            raise ConfigError(
                f"--nproc-per-node={config.nproc_per_node!r} (or another flag) rejected by "
                f"torch: {exc}",
                hint="use a process count, or a device kind this machine has",
            ) from exc
        worker_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    # One run id per launch, kept by every agent restart (see ddpkit.cluster.runid)
    run_id = launch_run_id(os.environ, args.rdzv_id, one_node=config.max_nodes == 1)
    if run_id is not None:
        worker_env[RUN_ID_VAR] = run_id
    # gloo's and NCCL's interface on several nodes: the one that reaches the rendezvous host
    worker_env |= ifname_env(os.environ, launch_config.max_nodes, launch_config.rdzv_endpoint)
    launch_config.log_line_prefix_template = with_host(config.log_line_prefix_template)
    _scale_read_timeout(launch_config, config)
    bind = rdzv_port.shared_store_bind(launch_config)
    if bind is not None and not launch_config.local_addr:
        launch_config.local_addr = bind  # the workers' MASTER_ADDR: where the store listens
    return LaunchPlan(launch_config, entrypoint, tuple(cmd_args), worker_env, bind)


def ifname_env(
    env: Mapping[str, str],
    max_nodes: int,
    rdzv_endpoint: str,
    route: Callable[[str], Interface | None] = route_interface,
    this_host: Callable[[str], bool] = is_this_host,
) -> dict[str, str]:
    """On several nodes, the variables of :data:`IFNAME_VARS` the user has not set, each
    naming the interface of this node's route to the rendezvous host (the rule and why:
    :mod:`ddpkit.cluster.rendezvous.ifname`); none known leaves both to the backends."""
    unset = unset_vars(env)
    if max_nodes <= 1 or not unset or not rdzv_endpoint:
        return {}
    host, _ = parse_rendezvous_endpoint(rdzv_endpoint, 0)  # only the host is used
    name = job_interface(host, env, route, this_host)
    return {} if name is None else dict.fromkeys(unset, name)


def _scale_read_timeout(launch_config: LaunchConfig, config: RunConfig) -> None:
    """c10d's store read timeout (torch: 60 s, too short at many nodes) grown with the job
    (:func:`~ddpkit.cluster.durations.scaled_bound`); a ``read_timeout`` given is kept."""
    if launch_config.rdzv_backend != "c10d" or "read_timeout" in dict(config.rdzv_conf):
        return
    ranks = launch_config.max_nodes * launch_config.nproc_per_node
    seconds = math.ceil(scaled_bound(rdzv_port.READ_TIMEOUT_S, ranks))  # torch reads an int
    launch_config.rdzv_configs["read_timeout"] = seconds


def _store_host_decided(config: RunConfig, env: Mapping[str, str]) -> RunConfig:
    """``config`` with ``is_host`` in its rendezvous settings when the SLURM job's endpoint
    says which node hosts the c10d store (``hosts_store``); an ``is_host`` given wins."""
    if config.rdzv_backend != "c10d" or any(key == "is_host" for key, _ in config.rdzv_conf):
        return config
    hosts = hosts_store(env, parse_rendezvous_endpoint(config.rdzv_endpoint, 0)[0])
    if hosts is None:
        return config
    return replace(config, rdzv_conf=(*config.rdzv_conf, ("is_host", "1" if hosts else "0")))


def launch(config: RunConfig) -> LaunchOutcome:
    """Run the workers on this node until they finish; never raises for a worker failure.
    The stop signal is passed on to them from here (:func:`.relay.relay_stop_signal`)."""
    relay.relay_stop_signal(os.environ)
    plan = build_launch_config(config)
    chosen = " ".join(
        f"{key}={plan.worker_env[key]}" for key in IFNAME_VARS if key in plan.worker_env
    )
    if chosen:
        why = "the interface of this node's route to the others"
        print(f"ddpkit run: workers get {chosen} ({why})", file=sys.stderr, flush=True)
    # The agent may host the store every worker connects to (2 connections a worker): raised
    # as ddpkit.init raises a rank's, and inherited by the workers (ddpkit.cluster.limits)
    largest = plan.launch_config.max_nodes * plan.launch_config.nproc_per_node
    raise_open_files(open_files_needed(largest, hosts_store=True))
    logs = _RecordingLogsSpecs(plan.launch_config.logs_specs)
    plan.launch_config.logs_specs = logs
    _leave_the_stop_signal_to_the_relay(plan.launch_config)
    bind = plan.shared_store_bind  # None: the workers share no store with the agent
    shared: AbstractContextManager[Any] = nullcontext()
    if bind is not None:
        shared = rdzv_shared_store_made_by(lambda _a, port: rdzv_port.host_shared_store(bind, port))
    with (
        _environ_restored(),
        _signal_handlers(plan.launch_config.signals_to_handle),
        tee_read_by(tee.tail_whole_lines),
        shared,
        deathsig.tied() as token,
    ):
        os.environ.update(plan.worker_env)  # torch's agent hands os.environ to the workers
        if token is not None:  # marks the workers and what they start: see deathsig
            os.environ[deathsig.TOKEN_VAR] = token
        # A store shared across restart rounds carries no attempt prefix (a restarted group
        # could read the previous attempt's gloo addresses and hang): each round gets its own
        # but in a one-node run of one round. The user's setting wins.
        if plan.shared_store_bind is None:
            os.environ.setdefault(_SHARED_RDZV_STORE_OPT_OUT, "1")
        # A taken rendezvous port is not the end of a SLURM job; `held` (the store this node
        # may host for the agent) must live until the agent is done.
        held = rdzv_port.claim(plan.launch_config, os.environ)
        try:
            entrypoint, args = deathsig.tie(plan.entrypoint, plan.args)
            with node_order.slurm_node_order(plan.launch_config, os.environ):
                elastic_launch(plan.launch_config, entrypoint)(*args)
        except ChildFailedError as exc:
            return failed_outcome(exc, logs.last)
        except SignalException as exc:
            return LaunchOutcome(128 + int(exc.sigval), interrupted_by=exc.sigval.name)
        except (TorchRendezvousError, torch.distributed.DistNetworkError) as exc:
            endpoint = plan.launch_config.rdzv_endpoint
            raise RendezvousError(
                f"rendezvous at {endpoint!r} ({plan.launch_config.rdzv_backend}) failed: "
                f"{' '.join(str(exc).split())[:300]}",
                hint="check --master-addr/--master-port (is the port taken?) or leave them "
                "out on one node to get a free port",
            ) from exc
        finally:
            del held  # its server stops with the agent's last reference
    return LaunchOutcome(0, log_dir=attempt_dir(logs.last))


def _leave_the_stop_signal_to_the_relay(launch_config: LaunchConfig) -> None:
    """Take the stop signal the ``ddpkit`` process holds out of torch's signals to handle
    (``PET_SIGNALS_TO_HANDLE``): the relay passes it on (:mod:`.relay`), where torch's
    handler would shut the workers down."""
    stop = stop_forward.held()
    if stop is None:
        return
    names = [name.strip() for name in launch_config.signals_to_handle.split(",")]
    kept = [name for name in names if name and getattr(signal, name, None) != stop]
    launch_config.signals_to_handle = ",".join(kept)


class _RecordingLogsSpecs(LogsSpecs):
    """Delegates to torch's LogsSpecs and remembers where the last attempt's logs went."""

    def __init__(self, inner: LogsSpecs | None) -> None:
        self._inner = inner if inner is not None else DefaultLogsSpecs()
        super().__init__(log_dir=self._inner.root_log_dir)
        self.last: LogsDest | None = None

    @property
    def root_log_dir(self) -> str:
        return self._inner.root_log_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        self.last = self._inner.reify(envs)
        return self.last


@contextmanager
def _environ_restored() -> Iterator[dict[str, str]]:
    """Undo every ``os.environ`` write made inside the block (torch's OMP_NUM_THREADS,
    TORCHELASTIC_SIGNALS_TO_HANDLE, TORCHINDUCTOR_CACHE_DIR); yields the snapshot."""
    before = dict(os.environ)
    try:
        yield before
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        for name, value in before.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


@contextmanager
def _signal_handlers(handled: str) -> Iterator[None]:
    """While the block runs, SIGUSR1/SIGUSR2 (but the stop signal, which the relay passes on)
    go to this process's children; afterwards the handlers of those and of torch's ``handled``
    signals are put back (torch never puts ours back)."""
    stop = stop_forward.held()
    forwarded = [sig for sig in relay.FORWARDED if sig != stop]
    named = (getattr(signal, name.strip(), None) for name in handled.split(","))
    saved = {sig: signal.getsignal(sig) for sig in named if isinstance(sig, signal.Signals)}
    for sig in forwarded:
        saved[sig] = signal.getsignal(sig)
        with suppress(ValueError):  # not the main thread: nothing installed, nothing forwarded
            signal.signal(sig, stop_forward.forward_now)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            with suppress(ValueError, TypeError):  # not the main thread / not a Python handler
                signal.signal(sig, handler)
