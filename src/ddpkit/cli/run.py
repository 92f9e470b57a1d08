"""``ddpkit run``: torchrun's flags (dash and underscore spellings), parsed without torch.

This module owns the argparse side of the subcommand: flag spellings, help text and printing.
Values stay raw text (None when not given) and become a ``RunConfig`` in exactly one place,
``ddpkit.launch.config.resolve_run_config``; the launcher is imported only to launch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

from ddpkit.contract import RUN_COMMAND
from ddpkit.launch.config import DEFAULTS, SWITCHES, RunConfig, resolve_run_config

__all__ = ["add_parser", "config_from_argv", "run_command"]

# dest -> (metavar, help); the default and the PET_ variable are appended from config.DEFAULTS.
_VALUED_HELP: dict[str, tuple[str, str]] = {
    "nnodes": ("N|MIN:MAX", "number of nodes, or an elastic range"),
    "nproc_per_node": ("N|auto|cpu|gpu|xpu", "worker processes per node"),
    "node_rank": ("RANK", "rank of this node (static rendezvous)"),
    "master_addr": ("HOST", "address of the node hosting rank 0 (static rendezvous)"),
    "master_port": ("PORT", "port on the master (static rendezvous); 29500 when needed"),
    "rdzv_backend": ("NAME", "rendezvous backend: static, c10d, etcd, etcd-v2"),
    "rdzv_endpoint": ("HOST[:PORT]", "rendezvous endpoint (c10d: port 29400 by default)"),
    "rdzv_id": ("ID", "job id shared by all nodes of one run"),
    "rdzv_conf": ("K=V,...", "extra rendezvous settings, e.g. join_timeout=900"),
    "max_restarts": ("N", "restarts of the whole worker group before giving up"),
    "monitor_interval": ("SECONDS", "how often the agent checks its workers"),
    "start_method": ("METHOD", "spawn, fork or forkserver (only with --run-path)"),
    "role": ("NAME", "worker role name"),
    "log_dir": ("DIR", "where worker logs go (default: a fresh temporary directory)"),
    "redirects": ("SPEC", "streams to log files only: 0 none, 1 out, 2 err, 3 both, 0:1,1:2 (0)"),
    "tee": ("SPEC", "streams to log files and console, same SPEC (3, or 0 with --redirects)"),
    "local_ranks_filter": ("RANKS", "show only these local ranks on the console, e.g. 0"),
    "local_addr": ("HOST", "address other nodes use to reach this one"),
    "numa_binding": (
        "MODE",
        "bind workers to CPUs near their GPUs: node, socket, exclusive, core-complex (torch 2.9+)",
    ),
}
_SWITCH_HELP: dict[str, str] = {
    "standalone": "one node, rendezvous on a free local port (implied on one node without "
    "--master-port or --rdzv-endpoint)",
    "module": "run SCRIPT as a module, like python -m",
    "no_python": "run SCRIPT as a command, without python in front",
    "run_path": "run SCRIPT with runpy.run_path inside the worker interpreter",
}
_SHORT = {"redirects": "-r", "tee": "-t", "module": "-m"}

_DESCRIPTION = """\
Launch SCRIPT on this node as torchrun would (same flags, defaults and PET_* variables; the
launch itself is torch.distributed.run's elastic agent), plus:
  * every worker output line is prefixed with its rank ("[rank0]: ") -- stdout and stderr are
    tee'd to log files unless you pass --tee or --redirects yourself;
  * when a worker fails, a short root-cause summary: rank, host, exit code or signal and the
    worker's traceback (from @record's error file or from its stderr log).
Precedence: command-line flag > PET_<FLAG> environment variable > default.
"""
_EPILOG = """\
Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT and TORCHELASTIC_* variables, and OMP_NUM_THREADS=1 when more than one runs per node
and it is unset (as under torchrun). The prefix template can be changed with
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (${rank}, ${local_rank}, ${role_name}, and
ddpkit's ${host}: this node's short host name, and ${pid}: the worker's process id).
Signals: SIGUSR2 (or DDPKIT_SIGNAL) is the stop signal: from the launcher's first line it is
passed on to the workers, kept for them when none runs yet; their preemption_guard() stops
with a checkpoint. SIGUSR1 is passed on too. Neither ever kills the launcher. With the
launcher gone (SIGKILL included), its workers die too (Linux).
Exit code: 0; 2 for bad flags; 75 when the workers stopped early with a checkpoint (run the
same command again to resume); else the failed worker's exit code (128+N for signal N).
examples:
  ddpkit run --nproc-per-node 2 train.py --epochs 3
  ddpkit run --nnodes 2 --node-rank 0 --master-addr node1 --nproc-per-node gpu train.py
  ddpkit run --dry-run --nproc-per-node 4 -m mypkg.train
"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register ``run`` on the ``add_subparsers()`` object of the top-level parser."""
    parser: argparse.ArgumentParser = commands.add_parser(
        RUN_COMMAND,
        help="launch a script on this node with torch's elastic agent (torchrun's flags)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    for dest, (metavar, text) in _VALUED_HELP.items():
        default = DEFAULTS[dest]
        shown = f"default: {default!r}; " if default is not None else ""
        parser.add_argument(
            *_spellings(dest),
            dest=dest,
            default=None,
            metavar=metavar,
            help=f"{text} ({shown}env PET_{dest.upper()})",
        )
    for dest in SWITCHES:
        parser.add_argument(
            *_spellings(dest),
            dest=dest,
            action="store_true",
            help=f"{_SWITCH_HELP[dest]} (env PET_{dest.upper()}=1)",
        )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the equivalent torchrun command line and exit",
    )
    parser.add_argument("script", metavar="SCRIPT", help="training script (or module, command)")
    parser.add_argument(
        "script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="passed on to SCRIPT"
    )
    parser.set_defaults(handler=run_command)
    return parser


def _spellings(dest: str) -> list[str]:
    """``--nproc-per-node`` and torchrun's legacy ``--nproc_per_node``, plus a short form."""
    dashed, underscored = "--" + dest.replace("_", "-"), "--" + dest
    names = [dashed] if dashed == underscored else [dashed, underscored]
    short = _SHORT.get(dest)
    return [short, *names] if short else names


def _flags(args: argparse.Namespace) -> dict[str, object]:
    names = [*DEFAULTS, *SWITCHES, "script", "script_args"]
    return {name: getattr(args, name) for name in names}


def config_from_argv(argv: list[str], env: Mapping[str, str] | None = None) -> RunConfig:
    """Parse ``ddpkit run`` arguments (without the ``run``) into a ``RunConfig``.

    ``env`` defaults to ``os.environ`` (read only). Usage errors raise ``SystemExit(2)`` as
    argparse does; bad values raise ``ConfigError``.
    """
    from ddpkit.cli import build_parser

    args = build_parser(RUN_COMMAND).parse_args([RUN_COMMAND, *argv])
    return resolve_run_config(_flags(args), os.environ if env is None else env)


def run_command(args: argparse.Namespace) -> int:
    """Handler of ``ddpkit run``: resolve the config, then launch (or print it with --dry-run)."""
    config = resolve_run_config(_flags(args), os.environ)
    if args.dry_run:
        print(config.torchrun_command())
        return 0
    from ddpkit.launch.local import launch

    outcome = launch(config)
    if outcome.exit_code != 0:
        sys.stdout.flush()  # worker output first, then the summary
        print(outcome.describe(), file=sys.stderr)
    return outcome.exit_code
