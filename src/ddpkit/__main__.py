"""``python -m ddpkit`` and the ``ddpkit`` console script.

Its first line holds ``ddpkit run``'s signals (:func:`ddpkit.launch.relay.hold`, which imports
only :mod:`ddpkit.cluster.stop`), before the command line's own imports and long before torch's:
SIGUSR1 and SIGUSR2 must not kill a launcher that is still starting.
"""

from __future__ import annotations

import os
import sys

from ddpkit.launch import relay


def main() -> int:
    """The ``ddpkit`` command: hold the launcher's signals, then run the command line."""
    relay.hold(sys.argv[1:], os.environ)
    from ddpkit.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
