"""Exit-race reproducer: a rank that gives up joining its store must exit without SIGABRT.

    python benchmarks/exit_race_rendezvous.py [--runs 500] [--connect-s 0.5] [--parallel 2]

Each run forks a rank (torch and ddpkit imported once, before the fork) that makes its store
as ``ddpkit.init`` does (:func:`ddpkit.worker.rendezvous.group.make_store`, rank 1 of 2 under
torchrun's variables) against a port where nothing listens yet; it gives up after
``--connect-s`` (a ``RendezvousError``) and exits, finalizing its interpreter. A helper process
hosts a real TCPStore on that port at a moment swept across runs, from before the give-up to
after the exit: a thread of ddpkit's still inside torch's client then returns from its C++ call
while the interpreter finalizes, which aborts the process ("terminate called without an active
exception", SIGABRT). Counts the runs that died of a signal (the figure: must be 0) and those
that printed anything else than ddpkit's own line (torch's C++ traces).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

# The helper: reads "port delay_s" lines, hosts a store on each port delay_s after reading it,
# and drops each store 5 s later.
_HOST = """
import sys, threading, time
from datetime import timedelta
from torch.distributed import TCPStore
held = []
def host(port, delay_s):
    time.sleep(delay_s)
    try:
        store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30),
                         wait_for_workers=False)
    except Exception:
        return
    held.append(store)
    time.sleep(5.0)
    held.remove(store)
print("ready", flush=True)
for line in sys.stdin:
    port, delay_s = line.split()
    threading.Thread(target=host, args=(int(port), float(delay_s)), daemon=True).start()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rank(port: int, connect_s: float, err_path: str) -> None:
    """In the forked child: stderr to ``err_path``, make the store, exit normally."""
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    from ddpkit.cluster.detect import detect
    from ddpkit.errors import RendezvousError
    from ddpkit.worker.rendezvous.group import make_store

    env = {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "race",
    }  # fmt: skip
    try:
        make_store(detect(env), env, connect_s, timedelta(seconds=5))
    except RendezvousError as exc:
        print(f"ddpkit: error: {exc.message}", file=sys.stderr, flush=True)
    # back to the top level: the interpreter finalizes as at any script's end


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--connect-s", type=float, default=0.5)
    parser.add_argument("--parallel", type=int, default=2, help="runs at once")
    args = parser.parse_args()
    import torch.distributed  # noqa: F401  (imported once, before the forks)

    import ddpkit.worker.rendezvous.group  # noqa: F401

    helper = subprocess.Popen(
        [sys.executable, "-c", _HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert helper.stdout is not None and helper.stdin is not None
    assert helper.stdout.readline() == "ready\n"
    scratch = Path(tempfile.mkdtemp(prefix="exit-race-"))
    running: dict[int, tuple[int, Path, float]] = {}
    aborted, noisy, done = [], [], 0
    started = time.monotonic()

    def reap(block: bool) -> None:
        nonlocal done
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        index, err, delay_s = running.pop(pid)
        done += 1
        text = err.read_text(errors="replace")
        lines = text.splitlines()
        if os.WIFSIGNALED(status):
            aborted.append((index, delay_s, signal.Signals(os.WTERMSIG(status)).name, text[-300:]))
        elif len(lines) > 1 or (lines and not lines[0].startswith("ddpkit: error:")):
            noisy.append((index, delay_s, len(lines)))
        err.unlink()

    for index in range(args.runs):
        while len(running) >= args.parallel:
            reap(block=True)
        port = free_port()
        # the store comes up from just before the give-up to well after the exit
        delay_s = args.connect_s * (0.8 + 1.6 * ((index * 0.618034) % 1.0))
        err = scratch / f"{index}.err"
        pid = os.fork()
        if pid == 0:
            helper.stdin.close()
            rank(port, args.connect_s, str(err))
            return 0
        helper.stdin.write(f"{port} {delay_s:.3f}\n")
        helper.stdin.flush()
        running[pid] = (index, err, delay_s)
    while running:
        reap(block=True)
    helper.stdin.close()
    helper.kill()
    helper.wait()
    took = time.monotonic() - started
    for index, delay_s, sig, tail in aborted[:5]:
        print(f"run {index} (store up {delay_s:.2f} s in): died of {sig}: {tail!r}")
    for index, delay_s, count in noisy[:5]:
        print(f"run {index} (store up {delay_s:.2f} s in): {count} lines on stderr")
    print(
        f"aborts: {len(aborted)}/{done} (goal 0); runs that printed more than ddpkit's line: "
        f"{len(noisy)}/{done}; {took:.0f} s"
    )
    return 1 if aborted else 0


if __name__ == "__main__":
    raise SystemExit(main())
