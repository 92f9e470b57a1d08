"""``RunConfig``: the validated description of one ``ddpkit run``, and the one function that
turns flags into it. Torch-free (``ddpkit --help`` and ``--dry-run`` stay fast);
``RunConfig.torchrun_argv`` goes back to a torchrun command line, which
``ddpkit.launch.local`` hands to torch's own parser so every flag means what it means there.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal, cast

from ddpkit.cluster.envvars import number_hint, parse_port, to_float, to_int
from ddpkit.errors import ConfigError
from ddpkit.hints import did_you_mean
from ddpkit.masking import assignment, mask_text

__all__ = ["DEFAULTS", "DEFAULT_LOG_LINE_PREFIX", "SWITCHES", "RunConfig", "resolve_run_config"]

NprocKeyword = Literal["auto", "cpu", "gpu", "xpu"]
StartMethod = Literal["spawn", "fork", "forkserver"]
NPROC_KEYWORDS: tuple[NprocKeyword, ...] = ("auto", "cpu", "gpu", "xpu")
START_METHODS: tuple[StartMethod, ...] = ("spawn", "fork", "forkserver")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
# torchrun's --numa-binding modes (torch.numa.binding.AffinityMode, torch 2.9 and newer)
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")

# torch's LocalElasticAgent substitutes ${rank}, ${local_rank} and ${role_name}.
DEFAULT_LOG_LINE_PREFIX = "[rank${rank}]: "
PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"

# Valued flags (argparse dest -> torchrun's default as text; None: no value unless given).
# The CLI builds its parser from this table and PET_<DEST upper-cased> is each flag's env fallback.
DEFAULTS: dict[str, str | None] = {
    "nnodes": "1:1",
    "nproc_per_node": "1",
    "node_rank": "0",
    "master_addr": "127.0.0.1",
    "master_port": None,  # 29500 for a static rendezvous; one node without it: --standalone
    "rdzv_backend": "static",
    "rdzv_endpoint": "",
    "rdzv_id": "none",
    "rdzv_conf": "",
    "max_restarts": "0",
    "monitor_interval": "0.1",
    "start_method": "spawn",
    "role": "default",
    "log_dir": None,
    "redirects": None,  # "0" when --tee is given, else ddpkit tees everything
    "tee": None,  # "3" (stdout+stderr, rank-prefixed) unless --tee or --redirects is given
    "local_ranks_filter": "",
    "local_addr": None,
    "numa_binding": None,
}
# On/off flags; PET_<NAME>=1 turns one on, as torchrun's check_env does.
SWITCHES = ("standalone", "module", "no_python", "run_path")

# Used with fullmatch: ``$`` also matches before a final newline ("3\n" is no stream spec).
# [0-9], not \d: \d matches every script's digits ("٣"), which int() then reads silently.
_STD_SPEC = re.compile(r"[0-3]|[0-9]+:[0-3](,[0-9]+:[0-3])*")
_ENDPOINT = re.compile(r"(\[[^\]]+\]|[^:\[\]\s]+)(:([0-9]+))?")
# --rdzv-conf keys torch reads as integers (seconds, counts): checked here, as every flag is
_RDZV_INT_KEYS = ("keep_alive_interval", "keep_alive_max_attempt")


@dataclass(frozen=True)
class RunConfig:
    """Everything ``ddpkit run`` needs, validated; field names follow torchrun's flags.
    ``standalone`` is true when given or implied (one node, static rendezvous, no master port
    nor endpoint: a free port, as torch's ``run()`` does)."""

    script: str
    script_args: tuple[str, ...] = ()
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int | NprocKeyword = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    standalone: bool = True
    max_restarts: int = 0
    monitor_interval_s: float = 0.1
    start_method: StartMethod = "spawn"
    role: str = "default"
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "3"
    local_ranks_filter: tuple[int, ...] = ()
    local_addr: str | None = None
    numa_binding: str | None = None
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    log_line_prefix_template: str = DEFAULT_LOG_LINE_PREFIX

    def torchrun_argv(self) -> list[str]:
        """The torchrun arguments with the same meaning (``torchrun`` itself not included)."""
        argv = [
            f"--nnodes={self.min_nodes}:{self.max_nodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}",
            f"--rdzv-backend={self.rdzv_backend}",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={','.join(f'{k}={v}' for k, v in self.rdzv_conf)}",
            f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={self.monitor_interval_s}",
            f"--start-method={self.start_method}",
            f"--role={self.role}",
            f"--redirects={self.redirects}",
            f"--tee={self.tee}",
            f"--local-ranks-filter={','.join(map(str, self.local_ranks_filter))}",
        ]
        optional = {"--master-port": self.master_port, "--log-dir": self.log_dir}
        optional["--local-addr"] = self.local_addr
        optional["--numa-binding"] = self.numa_binding
        argv += [f"{flag}={value}" for flag, value in optional.items() if value is not None]
        switches = {"--standalone": self.standalone, "--module": self.module}
        switches |= {"--no-python": self.no_python, "--run-path": self.run_path}
        argv += [flag for flag, on in switches.items() if on]
        return [*argv, self.script, *self.script_args]

    def torchrun_command(self) -> str:
        """A shell line running the same job under plain torchrun (what ``--dry-run`` prints)."""
        env = f"{PREFIX_ENV}={shlex.quote(self.log_line_prefix_template)}"
        return " ".join([env, "torchrun", *map(shlex.quote, self.torchrun_argv())])


class _Lookup:
    """Reads one flag by precedence; returns its text and the label to quote in errors."""

    def __init__(self, flags: Mapping[str, object], env: Mapping[str, str]) -> None:
        self._flags = flags
        self._env = env

    def optional(self, dest: str) -> tuple[str | None, str]:
        given = self._flags.get(dest)
        if given is not None:
            return str(given), "--" + dest.replace("_", "-")
        env_name = "PET_" + dest.upper()
        if self._env.get(env_name):  # torchrun treats an empty PET_ value as unset, too
            return self._env[env_name], env_name
        return DEFAULTS[dest], "--" + dest.replace("_", "-")

    def __call__(self, dest: str) -> tuple[str, str]:
        text, label = self.optional(dest)
        return ("" if text is None else text), label

    def given(self, dest: str) -> bool:
        return self.optional(dest)[0] is not None

    def switch(self, dest: str) -> bool:
        if self._flags.get(dest):
            return True
        env_name = "PET_" + dest.upper()
        text = self._env.get(env_name, "0") or "0"
        if text not in ("0", "1"):
            raise ConfigError(
                f"{assignment(env_name, text)} is not 0 or 1", hint=f"unset {env_name}"
            )
        return text == "1"


def resolve_run_config(flags: Mapping[str, object], env: Mapping[str, str]) -> RunConfig:
    """Turn parsed flags (argparse dests, None when not given) into a validated ``RunConfig``.
    Each flag: the flag, else ``PET_<FLAG>`` in ``env`` (torchrun's convention), else
    ``DEFAULTS``. Raises ``ConfigError`` naming the flag (or variable), its value and a hint."""
    get = _Lookup(flags, env)
    min_nodes, max_nodes = parse_nnodes(*get("nnodes"))
    port_text, port_label = get.optional("master_port")
    free = "use 1..65535, or leave it out on one node to get a free port"
    master_port = None if port_text is None else parse_port(port_label, port_text.strip(), free)
    backend = parse_choice(*get("rdzv_backend"), RDZV_BACKENDS)
    endpoint = parse_endpoint(*get("rdzv_endpoint"))
    implied = backend == "static" and not endpoint and master_port is None and max_nodes == 1
    redirects, tee = _streams(get)
    config = RunConfig(
        script=str(flags.get("script") or ""),
        script_args=tuple(str(a) for a in cast("list[object]", flags.get("script_args") or [])),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=parse_nproc(*get("nproc_per_node")),
        node_rank=parse_int(*get("node_rank"), minimum=0),
        master_addr=parse_nonempty(*get("master_addr")),
        master_port=master_port,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_id=parse_nonempty(*get("rdzv_id")),
        rdzv_conf=parse_rdzv_conf(*get("rdzv_conf")),
        standalone=get.switch("standalone") or implied,
        max_restarts=parse_int(*get("max_restarts"), minimum=0),
        monitor_interval_s=parse_positive_float(*get("monitor_interval")),
        start_method=cast(StartMethod, parse_choice(*get("start_method"), START_METHODS)),
        role=parse_nonempty(*get("role")),
        log_dir=get.optional("log_dir")[0] or None,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=parse_ranks(*get("local_ranks_filter")),
        local_addr=get.optional("local_addr")[0] or None,
        numa_binding=_numa_binding(get),
        module=get.switch("module"),
        no_python=get.switch("no_python"),
        run_path=get.switch("run_path"),
        log_line_prefix_template=env.get(PREFIX_ENV) or DEFAULT_LOG_LINE_PREFIX,
    )
    _check_node_rank(config)
    return _check_entrypoint(config)


def _numa_binding(get: _Lookup) -> str | None:
    text, label = get.optional("numa_binding")
    return None if text is None else parse_choice(text, label, NUMA_BINDINGS)


def _streams(get: _Lookup) -> tuple[str, str]:
    """(redirects, tee): torchrun's "0" for each unless neither is given, then tee both ("3")."""
    if not (get.given("redirects") or get.given("tee")):
        return "0", "3"
    redirects, redirects_label = get("redirects")
    tee, tee_label = get("tee")
    return parse_std(redirects or "0", redirects_label), parse_std(tee or "0", tee_label)


def parse_nnodes(text: str, label: str = "--nnodes") -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> (min, max), with 0 < min <= max."""
    parts = [to_int(part.strip()) for part in text.split(":")]
    hint = "use N or MIN:MAX with 0 < MIN <= MAX, e.g. --nnodes 2 or --nnodes 1:4"
    low, high = parts[0], parts[-1]
    if len(parts) > 2 or low is None or high is None:
        raise ConfigError(
            f"{assignment(label, text)} is not N or MIN:MAX", hint=number_hint(text, hint)
        )
    if not 0 < low <= high:
        raise ConfigError(f"{assignment(label, text)} needs 0 < MIN <= MAX", hint=hint)
    return low, high


def parse_nproc(text: str, label: str = "--nproc-per-node") -> int | NprocKeyword:
    """A positive process count or one of ``auto``, ``cpu``, ``gpu``, ``xpu``."""
    if text in NPROC_KEYWORDS:
        return text
    hint = f"use a positive integer or one of {', '.join(NPROC_KEYWORDS)}"
    hint = number_hint(text, did_you_mean(text, NPROC_KEYWORDS, hint=hint))
    count = to_int(text.strip())
    if count is None or count < 1:
        raise ConfigError(f"{assignment(label, text)} is not a process count", hint=hint)
    return count


def parse_int(text: str, label: str, *, minimum: int) -> int:
    """An integer >= ``minimum`` (ASCII digits)."""
    value = to_int(text.strip())
    if value is None or value < minimum:
        hint = number_hint(text, f"e.g. {label}={minimum}")
        raise ConfigError(f"{assignment(label, text)} is not an integer >= {minimum}", hint=hint)
    return value


def parse_positive_float(text: str, label: str, example: str = "0.1") -> float:
    """A float > 0 (seconds), in ASCII digits."""
    value = to_float(text.strip())
    if value is None or not value > 0:
        hint = number_hint(text, f"e.g. {label}={example}")
        raise ConfigError(f"{assignment(label, text)} is not a positive number", hint=hint)
    return value


def parse_choice(text: str, label: str, choices: tuple[str, ...]) -> str:
    """One of ``choices``; a near miss gets a "did you mean"."""
    if text in choices:
        return text
    raise ConfigError(
        f"{assignment(label, text)} is not supported",
        hint=did_you_mean(text, choices, hint=f"choose one of {', '.join(choices)}"),
    )


def parse_nonempty(text: str, label: str) -> str:
    """Any non-blank text."""
    if not text.strip():
        raise ConfigError(
            f"{assignment(label, text)} is empty", hint=f"give {label} a value or omit it"
        )
    return text


def parse_endpoint(text: str, label: str = "--rdzv-endpoint") -> str:
    """Empty, ``host`` or ``host:port`` (IPv6 hosts in brackets)."""
    match = _ENDPOINT.fullmatch(text)
    if text and (match is None or (match.group(3) and not 0 < int(match.group(3)) < 65536)):
        hint = number_hint(text, "e.g. node1:29400 or [::1]:29400")
        raise ConfigError(f"{assignment(label, text)} is not HOST[:PORT]", hint=hint)
    return text


def parse_rdzv_conf(text: str, label: str = "--rdzv-conf") -> tuple[tuple[str, str], ...]:
    """``k1=v1,k2=v2`` -> ((k1, v1), (k2, v2))."""
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(
                f"{assignment(label, text)} has {mask_text(item)!r}, not KEY=VALUE",
                hint="e.g. --rdzv-conf join_timeout=900,read_timeout=60",
            )
        pairs.append((key.strip(), _rdzv_value(key.strip(), value.strip(), label)))
    return tuple(pairs)


def _rdzv_value(key: str, value: str, label: str) -> str:
    """A value torch reads as an integer (``*timeout``, keep-alive settings) must be one."""
    if not (key.endswith("timeout") or key in _RDZV_INT_KEYS):
        return value
    number = to_int(value)
    if number is None or number < 0:
        example = "900 (whole seconds)" if key.endswith("timeout") else "5"
        hint = number_hint(value, f"e.g. {key}={example}")
        raise ConfigError(f"{label} has {assignment(key, value)}, not an integer >= 0", hint=hint)
    return value


def parse_std(text: str, label: str) -> str:
    """A torchrun ``Std`` spec: 0 none, 1 stdout, 2 stderr, 3 both; or per local rank."""
    if not _STD_SPEC.fullmatch(text):
        hint = number_hint(text, "0 none, 1 stdout, 2 stderr, 3 both; per local rank: 0:1,1:2")
        raise ConfigError(f"{assignment(label, text)} is not a stream spec", hint=hint)
    return text


def parse_ranks(text: str, label: str = "--local-ranks-filter") -> tuple[int, ...]:
    """Comma-separated local ranks (empty: no filter)."""
    ranks = [to_int(part.strip()) for part in text.split(",")] if text.strip() else []
    if not all(rank is not None and rank >= 0 for rank in ranks):
        hint = number_hint(text, f"e.g. {label}=0,1")
        raise ConfigError(f"{assignment(label, text)} is not a list of local ranks", hint=hint)
    return tuple(sorted({rank for rank in ranks if rank is not None}))


def _check_node_rank(config: RunConfig) -> None:
    static = config.rdzv_backend == "static" and not config.standalone
    if static and config.node_rank >= config.max_nodes:
        raise ConfigError(
            f"--node-rank={config.node_rank} is not below --nnodes={config.max_nodes}",
            hint="node ranks count from 0 to nnodes - 1",
        )


def _check_entrypoint(config: RunConfig) -> RunConfig:
    """The script must exist (a module and a --no-python command are looked up differently)."""
    script = config.script
    if not script:
        raise ConfigError("no script given", hint="usage: ddpkit run [flags] SCRIPT [ARGS...]")
    if config.module and config.no_python:
        raise ConfigError(
            f"--module and --no-python both given for {script!r}",
            hint="-m runs a Python module; --no-python runs a command: pick one",
        )
    if config.module:
        return config  # resolved by the workers' interpreter, on their sys.path
    if config.no_python and not config.run_path:
        if not os.path.isfile(script) and shutil.which(script) is None:
            raise ConfigError(
                f"command {script!r} not found", hint="give a path or a command on PATH"
            )
        return config
    if not os.path.isfile(script):
        what = "is a directory" if os.path.isdir(script) else "not found"
        raise ConfigError(
            f"script {script!r} {what}",
            hint=f"paths are relative to {os.getcwd()}; use -m for a module, "
            "--no-python for a command",
        )
    if config.run_path:  # torch runs it with runpy.run_path, which wants an absolute path
        return replace(config, script=os.path.abspath(script))
    return config
