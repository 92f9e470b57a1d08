"""Exit-race reproducers: a finished 2-rank job must never abort at exit.

    python benchmarks/exit_race.py staggered [--runs 500]
    python benchmarks/exit_race.py host-vanishes [--runs 500]

The abort class (``terminate called without an active exception``, SIGABRT): a daemon thread
of ddpkit's returns from a torch C++ call (a TCPStore operation) while the interpreter
finalizes. Each run is a 2-rank gloo job under ``ddpkit.init()`` (peer bound 2 s: the watchdog
beats every 0.5 s, each store call bounded by 1 s) that does one all-reduce, then:

* ``staggered``: each rank waits a random offset in [0, 0.6) s (more than a beat interval,
  so the exits land at every moment of the watchdog's beat phase), then ends normally
  (interpreter finalization). Rank 0 hosts the store: its exit takes the store away while
  rank 1's watchdog may be inside a store call.
* ``host-vanishes``: rank 1 ends normally after a random offset in [0, 0.6) s; rank 0, the
  store's host, is killed (SIGKILL) at another random offset in the same range: the store
  vanishes before, during or after rank 1's exit steps.

The ranks are forked from one parent that imported torch and ddpkit once (no thread runs
there), so a run costs the job, not the imports; each child ends through the interpreter's
normal finalization. An abort is a rank ended by SIGABRT or one whose stderr says
``terminate called``. Prints the count of aborts, of other unexpected exit codes (anything
but 0 for a rank that was not killed), and the runs' wall time.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ddpkit

OFFSET_S = 0.6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


PLAIN: list[bool] = [False]  # --plain: the same job under plain torch, no ddpkit.init()


def rank_main(rank: int, port: int, offset_s: float, err: Path) -> None:
    """One rank, in a forked child: its stderr to ``err``; returns into finalization."""
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", DDPKIT_PEER_TIMEOUT="2",
    )  # fmt: skip
    if PLAIN[0]:
        dist.init_process_group("gloo")
    else:
        ddpkit.init(backend="gloo")
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    err.with_suffix(".ready").touch()  # both ranks joined: the offsets count from here
    time.sleep(offset_s)


def fork_rank(rank: int, port: int, offset_s: float, err: Path) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            rank_main(rank, port, offset_s, err)
        except SystemExit as done:
            code = int(done.code or 0)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        sys.exit(code)  # the child unwinds to the top: the interpreter finalizes as usual
    return pid


def one_run(mode: str, rng: random.Random, folder: Path) -> tuple[int, int]:
    """(aborts, other unexpected exits) of one job."""
    port = free_port()
    errs = [folder / f"rank{rank}.err" for rank in (0, 1)]
    for err in errs:
        err.with_suffix(".ready").unlink(missing_ok=True)
    offsets = [rng.uniform(0, OFFSET_S), rng.uniform(0, OFFSET_S)]
    killed = mode == "host-vanishes"
    pids = [fork_rank(rank, port, 3600.0 if killed and rank == 0 else offsets[rank], errs[rank])
            for rank in (0, 1)]  # fmt: skip
    if killed:  # rank 0's kill: its offset after the all-reduce
        ready = errs[0].with_suffix(".ready")
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(offsets[0])
        os.kill(pids[0], signal.SIGKILL)
    aborts = others = 0
    for rank, pid in enumerate(pids):
        _, status = os.waitpid(pid, 0)
        text = errs[rank].read_text(errors="replace")
        aborted = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT
        if aborted or "terminate called" in text:
            aborts += 1
        elif not (killed and rank == 0) and os.waitstatus_to_exitcode(status) != 0:
            others += 1
            print(f"rank {rank} exit {os.waitstatus_to_exitcode(status)}: {text[-600:]}")
    return aborts, others


def run_share(
    mode: str, runs: int, rng: random.Random, folder: Path, until: float
) -> tuple[int, int, int]:
    """(runs done, aborts, other unexpected exits) of up to ``runs`` runs, none begun after
    ``until`` (monotonic); each run's counts appended to ``folder/counts`` as it ends."""
    aborts = others = done = 0
    for _ in range(runs):
        if time.monotonic() >= until:
            break
        found, odd = one_run(mode, rng, folder)
        aborts, others, done = aborts + found, others + odd, done + 1
        with open(folder / "counts", "a") as out:
            out.write(f"{found} {odd}\n")
        if found:
            print(f"run {done}: {found} abort(s)", flush=True)
    return done, aborts, others


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["staggered", "host-vanishes"])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="plain torch, no ddpkit.init()")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each 2 ranks)")
    parser.add_argument("--minutes", type=float, default=0.0, help="begin no run after (0: none)")
    args = parser.parse_args()
    PLAIN[0] = args.plain
    aborts = others = done = 0
    started = time.monotonic()
    until = started + args.minutes * 60 if args.minutes > 0 else float("inf")
    folder = Path(tempfile.mkdtemp())  # no context manager: a child unwinds through here
    parent = os.getpid()
    try:
        runners = []
        for job in range(args.jobs):  # each a forked runner of its share of the runs
            runs = args.runs // args.jobs + (job < args.runs % args.jobs)
            (folder / str(job)).mkdir()
            pid = os.fork()
            if pid == 0:
                run_share(args.mode, runs, random.Random(args.seed * 100 + job),
                          folder / str(job), until)  # fmt: skip
                os._exit(0)
            runners.append(pid)
        for job, pid in enumerate(runners):
            os.waitpid(pid, 0)
            counts = folder / str(job) / "counts"
            for line in counts.read_text().splitlines() if counts.exists() else []:
                found, odd = map(int, line.split())
                aborts, others, done = aborts + found, others + odd, done + 1
    finally:
        if os.getpid() == parent:
            shutil.rmtree(folder, ignore_errors=True)
    took = time.monotonic() - started
    print(f"exit_race {args.mode}: {aborts} aborts/{done} runs, {others} other unexpected "
          f"exit codes, {took:.0f} s ({took / max(1, done):.2f} s a run)")  # fmt: skip


if __name__ == "__main__":
    main()
