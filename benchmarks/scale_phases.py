"""Where a simulated ddpkit rank's time to ready goes: one job of N ranks, per step of start-up.

    python benchmarks/scale_phases.py [--procs 2] 1024 2048

The same simulated ranks as ``bench_scale.py`` (:mod:`scalesim`, ddpkit's own code), stamped at
the end of each step: connected (the store's handshake + torch's client), formed (every rank
joined), linked (the watchdog sets out to connect, in ``init()``), cloned (its own connection
made), ready (``init()`` returns: the watchdog's thread started). Prints, per step, the spread
over ranks (p50/p90/p99/max seconds), when the last rank finished it (and "introduced": rank
0's, with every beat key, comes after its connection), and the CPU time the thread that did it
spent (``thread_cpu_ms``: p50 and mean over ranks, in ms, of the rank's own thread; "linked" to
"cloned" is the watchdog's connect, inside "formed" to "ready"). A diagnostic, not a figure of
the report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scalesim

STEPS = ("start", "connected", "formed", "linked", "cloned", "ready")  # on every rank, in order
LAST = (*STEPS, "introduced")
# steps whose two stamps are taken on one thread (the rank's own): the CPU time it spent on the
# step; "linked->cloned", the watchdog's own connect, is a part of "formed->ready"
CPU_STEPS = (("start", "connected"), ("connected", "formed"), ("formed", "ready"),
             ("linked", "cloned"))  # fmt: skip


def worker(ranks: list[int], world: int, port: int, go: Any, out: Any, variant: str) -> None:  # noqa: PLR0917
    sims, threads, line = scalesim.loaded(ranks, world, port, variant)
    out.put("loaded")
    go.wait()
    line.set()
    for thread in threads:
        thread.join()
    out.put(([sim.timeline() for sim in sims], [sim.error for sim in sims if sim.error][:3]))
    scalesim.stop_links(sims, 10)


def job(world: int, procs: int, variant: str = "ddpkit") -> dict[str, Any]:
    ctx = scalesim.context()
    port, go, out = scalesim.listen_port(), ctx.Event(), ctx.Queue()
    children = [ctx.Process(target=worker, args=(c, world, port, go, out, variant))
                for c in scalesim.chunks(world, procs)]  # fmt: skip
    for child in children:
        child.start()
    for _ in children:
        out.get(timeout=300)
    rank0 = scalesim.Rank(0, world, port, variant)
    host = threading.Thread(target=rank0.run, daemon=True)
    host.start()
    scalesim.wait_listening(port)
    start = time.monotonic()
    go.set()
    stamps: list[dict[str, float]] = []
    errors: list[str] = []
    for _ in children:
        got, errs = out.get(timeout=900)
        stamps += got
        errors += errs
    host.join(600)
    stamps.append(rank0.timeline())
    for child in children:
        child.join(30)
    scalesim.stop_links([rank0])
    if errors or rank0.error:
        raise RuntimeError(f"N={world}: {[*errors, rank0.error or ''][:3]}")
    steps = [step for step in STEPS if step in stamps[0]]
    figures: dict[str, Any] = {"N": world, "procs": procs, "variant": variant}
    last = [step for step in LAST if step in stamps[0]]
    figures["last_at_s"] = {s: round(max(t[s] for t in stamps) - start, 3) for s in last}
    for before, after in itertools.pairwise(steps):
        spent = sorted(t[after] - t[before] for t in stamps)
        at = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
        spread = {k: round(spent[int(q * (len(spent) - 1))], 3) for k, q in at.items()}
        figures[f"{before}->{after}"] = {**spread, "max": round(spent[-1], 3)}
    cpu_ms = {}
    for before, after in CPU_STEPS:
        if f"cpu:{before}" in stamps[0] and f"cpu:{after}" in stamps[0]:
            spent = sorted(t[f"cpu:{after}"] - t[f"cpu:{before}"] for t in stamps)
            cpu_ms[f"{before}->{after}"] = {
                "p50": round(1000 * spent[len(spent) // 2], 3),
                "mean": round(1000 * sum(spent) / len(spent), 3),
            }
    figures["thread_cpu_ms"] = cpu_ms
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("worlds", type=int, nargs="+")
    parser.add_argument("--procs", type=int, default=2, help="processes holding the ranks")
    parser.add_argument(
        "--variant", choices=("ddpkit", "ddpkit-rendezvous", "plain"), default="ddpkit"
    )
    args = parser.parse_args()
    print(scalesim.resolver_answers(), flush=True)
    for world in args.worlds:
        print(json.dumps(job(world, args.procs, args.variant)), flush=True)


if __name__ == "__main__":
    main()
