"""``ddpkit env`` and ``ddpkit doctor``: their flags, and printing their reports.

The work is in :mod:`ddpkit.tools`; this module only turns flags into a call. ``env`` imports
torch only for its ``backends`` section (``--no-torch`` skips it); ``doctor`` needs torch and
imports it when it runs, never at parser time.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ddpkit.cli import add_command
from ddpkit.launch.config import parse_int, parse_positive_float

__all__ = ["add_parsers"]

_ENV_DESCRIPTION = """\
One report of the distributed setup to paste into a bug report: versions, GPUs and
CUDA_VISIBLE_DEVICES, the launcher ddpkit detects and its rank record, the SLURM_*, MASTER_*,
NCCL_*, GLOO_*, TORCH_*, DDPKIT_* variables (secret-looking values masked), network interfaces
and which one gloo / NCCL would use. Only the backends section imports torch.
"""
_DOCTOR_DESCRIPTION = """\
Check that a job can start and communicate, one line per check: PASS, WARN or FAIL with a
hint. Run it alone, under `ddpkit run --nproc-per-node N -m ddpkit doctor`, or in an
allocation (`srun ddpkit doctor`). Every step is bounded by --timeout; ranks that never show
up are named. Then an all_reduce sweep (latency, algbw, busbw = algbw*2(n-1)/n as nccl-tests)
on gloo, and NCCL where GPUs exist, beside a raw socket transfer and a memcpy.
Exit code: 0 when nothing failed, 1 when a check failed, 2 for bad flags.
"""


def add_parsers(commands: Any) -> None:
    """Register ``env`` and ``doctor`` on the top-level ``add_subparsers()`` object."""
    env_help = "print the distributed setup for a bug report"
    env = add_command(commands, "env", env_help, env_command, _ENV_DESCRIPTION)
    env.add_argument("--json", action="store_true", help="one JSON object instead of text")
    env.add_argument(
        "--no-torch", action="store_true", help="skip the backends section (no torch import)"
    )
    doctor_help = "check that the job can start and communicate"
    doctor = add_command(commands, "doctor", doctor_help, doctor_command, _DOCTOR_DESCRIPTION)
    doctor.add_argument(
        "--timeout", default="30", metavar="SECONDS", help="bound of every step (default 30)"
    )
    doctor.add_argument("--quick", action="store_true", help="fewer message sizes (4 B .. 4 MiB)")
    doctor.add_argument("--no-comm", action="store_true", help="skip the all_reduce sweep")
    doctor.add_argument(
        "--dir",
        action="append",
        default=[],
        metavar="PATH",
        help="a log or checkpoint folder whose free space to check "
        "(repeatable; default: the current folder)",
    )
    doctor.add_argument(
        "--min-free-gb", default="1", metavar="GB", help="free space below this fails (default 1)"
    )
    doctor.add_argument(
        "--world-size",
        default=None,
        metavar="N",
        help="check open files and the listen backlog for a job of N ranks "
        "(default: this job's world size)",
    )
    doctor.add_argument("--json", action="store_true", help="one JSON object instead of text")


def env_command(args: argparse.Namespace) -> int:
    from ddpkit.tools import envreport

    report = envreport.build_report(torch=not args.no_torch)
    text = json.dumps(report, indent=2) + "\n" if args.json else envreport.format_report(report)
    sys.stdout.write(text)
    return 0


def doctor_command(args: argparse.Namespace) -> int:
    from ddpkit.tools.doctor import DoctorOptions, run_doctor

    options = DoctorOptions(
        timeout_s=parse_positive_float(args.timeout, "--timeout", "30"),
        quick=args.quick,
        comm=not args.no_comm,
        folders=tuple(args.dir),
        min_free_gb=parse_positive_float(args.min_free_gb, "--min-free-gb", "5"),
        world_size=None
        if args.world_size is None
        else parse_int(args.world_size, "--world-size", minimum=1),
    )
    report = run_doctor(options)
    if report.rank == 0:
        print(report.to_json() if args.json else report.text(), flush=True)
    elif report.failed:  # what this rank could not deliver to rank 0, or rank 0's verdict
        print(report.to_json() if args.json else report.text(problems_only=True), flush=True)
    return 1 if report.failed else 0
