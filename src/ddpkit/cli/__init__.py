"""The ``ddpkit`` command: one argparse parser with a subcommand per feature.

This module owns the process-level contract of the CLI: exit codes and how errors look.
``main`` returns instead of exiting (``python -m ddpkit`` and the console script exit with its
value), so tests can call it in-process. Importing it never imports torch: subcommands import
their heavy parts only when they run, so ``ddpkit --help`` answers at once.

A ``DdpkitError`` is printed as one line ``ddpkit: error: <message>``, without a traceback,
and exits with its class's ``exit_code`` (:mod:`ddpkit.errors`); Ctrl-C prints
``ddpkit: interrupted`` and exits 130; otherwise the code is the subcommand's. The table of
exit codes is in docs/reference/cli.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ddpkit import __version__
from ddpkit.cli import run as run_cmd
from ddpkit.contract import RUN_COMMAND
from ddpkit.errors import DdpkitError

__all__ = ["add_command", "build_parser", "main"]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ddpkit`` parser; each subcommand stores its handler as ``args.handler``.
    ``command="run"`` builds ``ddpkit run``'s alone: a launch does not import the job
    commands' modules, which torchrun does not pay for."""
    parser = argparse.ArgumentParser(
        prog="ddpkit",
        description="Distributed PyTorch training without the boilerplate.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run_cmd.add_parser(commands)
    if command != RUN_COMMAND:
        from ddpkit.cli import jobs as jobs_cmd
        from ddpkit.cli import tools as tools_cmd

        jobs_cmd.add_parsers(commands)
        tools_cmd.add_parsers(commands)
    return parser


def add_command(
    commands: Any,
    name: str,
    text: str,
    handler: Callable[[argparse.Namespace], int],
    description: str | None = None,
) -> argparse.ArgumentParser:
    """Register subcommand ``name`` of the job and tool commands: ``text`` its line in
    ``ddpkit --help``, ``description`` its own help's (default: ``text`` as a sentence)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name,
        help=text,
        description=description or text[0].upper() + text[1:] + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``ddpkit`` command line (``argv`` defaults to ``sys.argv[1:]``); return the code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    try:
        args = parser.parse_args(argv)
        code: int = args.handler(args)
    except SystemExit as stop:  # argparse: --help/--version (0) and usage errors (2)
        status = stop.code  # argparse's int; None or text from elsewhere: 0 or 1
        return status if isinstance(status, int) else 0 if status is None else 1
    except DdpkitError as exc:
        print(f"ddpkit: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback
        print("ddpkit: interrupted", file=sys.stderr)
        return 130
    return code
