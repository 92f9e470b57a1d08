"""The two plain idioms that change what a later idiom would meet, in one job: the script's own
signal handlers (own_signals.py: SIGTERM's installed before the group, SIGUSR1's after, both
received and kept), then one rank's ``sys.exit(3)`` after the job's last collective
(exit_three.py), which ends the job with rank 1's exit code 3 while rank 0 ends normally. The
handlers stay installed to the end, as in a script of the Lightning shape that exits with a
code; neither idiom changes what the other computes or prints. One launch under each launcher
instead of one each (a pair of launches is 5-12 s of CPU, mostly torch's import)."""

from __future__ import annotations

import sys

import exit_three
import own_signals
from corpus_start import finish, start


def main() -> int:
    print("--- own_signals", flush=True)
    own_signals.before_group()
    rank, world_size = start()
    own_signals.exercise(rank, world_size)
    print("--- exit_three", flush=True)
    code = exit_three.exercise(rank, world_size)
    if code == 0:
        finish()
    return code


if __name__ == "__main__":
    sys.exit(main())
