"""Worker for tests/test_run.py that never imports torch (fast to start).

Prints ``env RANK=.. LOCAL_RANK=.. ...`` and ``args <json of sys.argv[1:]>``; with
``--exit-rank R --code C`` the worker of global rank R exits with code C without raising.
"""

from __future__ import annotations

import json
import os
import sys

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")
KEYS += ("TORCHELASTIC_RESTART_COUNT",)

if __name__ == "__main__":
    print("env " + " ".join(f"{k}={os.environ.get(k)}" for k in KEYS))
    print("args " + json.dumps(sys.argv[1:]))
    argv = sys.argv[1:]
    if "--exit-rank" in argv and argv[argv.index("--exit-rank") + 1] == os.environ["RANK"]:
        sys.exit(int(argv[argv.index("--code") + 1]))
