"""Worker for tests/launch/test_run.py that never imports torch (fast to start).

Prints ``env RANK=.. LOCAL_RANK=.. ...`` and ``args <json of sys.argv[1:]>``; with
``--exit-rank R --code C`` the worker of global rank R exits with code C without raising
(``--await-dir DIR``: once every rank has printed its lines); with
``--die-rank R --die HOW`` it logs a handled exception, says so on stderr, then dies of a
signal: ``abort`` (os.abort), ``segv`` (a real segmentation fault: ctypes reads address 0),
or a signal name it sends itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")
KEYS += ("TORCHELASTIC_RESTART_COUNT",)


def _printed(folder: str, wait: bool) -> None:
    """Say this rank has printed (``printed-<RANK>`` in ``folder``); with ``wait`` (the rank
    about to fail), wait (60 s at most) until every rank has: its failure makes torch's agent
    end the others, and a rank ended before its first line (slower to start) printed nothing."""
    with open(os.path.join(folder, f"printed-{os.environ['RANK']}"), "w"):
        pass
    deadline = time.monotonic() + 60
    world = int(os.environ["WORLD_SIZE"])
    while wait and len([n for n in os.listdir(folder) if n.startswith("printed-")]) < world:
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


if __name__ == "__main__":
    print("env " + " ".join(f"{k}={os.environ.get(k)}" for k in KEYS), flush=True)
    print("args " + json.dumps(sys.argv[1:]), flush=True)
    argv = sys.argv[1:]
    exits = "--exit-rank" in argv and argv[argv.index("--exit-rank") + 1] == os.environ["RANK"]
    if "--await-dir" in argv:  # every rank says so; the one that exits waits for the others
        _printed(argv[argv.index("--await-dir") + 1], wait=exits)
    if exits:
        sys.exit(int(argv[argv.index("--code") + 1]))
    if "--die-rank" in argv and argv[argv.index("--die-rank") + 1] == os.environ["RANK"]:
        how = argv[argv.index("--die") + 1]
        try:  # a handled error logged earlier: its traceback is not the cause of the death
            raise ValueError("handled")
        except ValueError:
            traceback.print_exc()
        print(f"rank {os.environ['RANK']} dies by {how}", file=sys.stderr, flush=True)
        if how == "abort":
            os.abort()
        if how == "segv":
            import ctypes

            ctypes.string_at(0)
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(60)  # a blocked or ignored signal: never the test's intent
