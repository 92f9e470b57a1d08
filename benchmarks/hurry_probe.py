"""Every survivor of a failed collective looks for the peer that left at once: who names whom.

    python benchmarks/hurry_probe.py 64 1024

The simulated ranks of ``bench_scale.py`` (:mod:`scalesim`, 16 to a process, ddpkit's own
watchdog links) come up; a few beat intervals later one rank's link stops (a rank killed, no
marker), and 0.3 s after, every other rank's link is hurried as a failed collective's
excepthook hurries it, and read as it reads it (``watcher._wait_for_cause`` without markers:
up to 2.5 s, 5 s while the answer may still come). Prints how many named the stopped rank,
another rank ("wrong:<rank>"), nobody ("none") or did not know in time ("unknown"), how long
they took, and the CPU the store's thread spent meanwhile. A diagnostic, not a figure of the
report.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale
import scalesim

from ddpkit.worker.watchdog.policy import beat_interval_for

VICTIM = 5
HURRY_S, WAIT_S = 5.0, 2.5


def judge(link: Any, started: float) -> tuple[str, float]:
    """As watcher._wait_for_cause without markers: (outcome, seconds)."""
    link.hurry(HURRY_S)
    while True:
        now = time.monotonic()
        silent = link.silent()
        if silent:
            named = "victim" if silent[0].rank == VICTIM else f"wrong:{silent[0].rank}"
            return named, now - started
        late = silent is None and link.alive() and now - started < 2 * WAIT_S
        if now - started >= WAIT_S and not late:
            return ("none" if silent == [] else "unknown"), now - started
        time.sleep(0.05)


def worker(ranks: list[int], world: int, port: int, events: Any, out: Any) -> None:
    bench_scale.raise_fd_limit()
    threading.stack_size(256 * 1024)
    scalesim.instrument()
    go, kill, fail = events
    sims = [scalesim.Rank(rank, world, port, "ddpkit") for rank in ranks]
    threads, line = scalesim.held(sims)
    out.put("loaded")
    go.wait()
    line.set()
    for thread in threads:
        thread.join()
    out.put("ready")
    kill.wait()
    for sim in sims:
        if sim.rank == VICTIM and sim.link is not None:
            sim.link.stop(wait_s=0)
    fail.wait()
    started = time.monotonic()
    results: list[tuple[str, float]] = []
    lock = threading.Lock()

    def one(sim: Any) -> None:
        got = judge(sim.link, started)
        with lock:
            results.append(got)

    live = [s for s in sims if s.rank != VICTIM]
    ts = [threading.Thread(target=one, args=(s,)) for s in live]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out.put(results)
    scalesim.stop_links(sims, 5)


def main() -> None:
    world = int(sys.argv[1])
    procs = max(1, world // 16)
    ctx = scalesim.context()
    port = scalesim.listen_port()
    events = (ctx.Event(), ctx.Event(), ctx.Event())
    out: Any = ctx.Queue()
    others = list(range(1, world))
    chunks = [others[i::procs] for i in range(procs) if others[i::procs]]
    children = [ctx.Process(target=worker, args=(c, world, port, events, out)) for c in chunks]
    for c in children:
        c.start()
    for _ in children:
        assert out.get(timeout=300) == "loaded"
    rank0 = scalesim.Rank(0, world, port, "ddpkit")
    host = threading.Thread(target=rank0.run, daemon=True)
    host.start()
    scalesim.wait_listening(port)
    events[0].set()
    for _ in children:
        assert out.get(timeout=600) == "ready"
    host.join(600)
    bi = beat_interval_for(60.0, world)
    time.sleep(3 * bi + 2)
    events[1].set()
    time.sleep(0.3)
    cpu = scalesim.store_threads_cpu()
    events[2].set()
    started = time.monotonic()
    results = [judge(rank0.link, started)]
    for _ in children:
        results += out.get(timeout=600)
    store_s = scalesim.store_cpu_since(cpu)
    kinds: dict[str, int] = {}
    for kind, _ in results:
        kinds[kind] = kinds.get(kind, 0) + 1
    times = sorted(t for _, t in results)
    print(
        {
            "N": world,
            "beat_interval": bi,
            "outcomes": kinds,
            "t_p50": round(times[len(times) // 2], 2),
            "t_max": round(times[-1], 2),
            "store_cpu_s": round(store_s, 2),
        },
        flush=True,
    )
    for c in children:
        c.join(30)
    scalesim.stop_links([rank0])


if __name__ == "__main__":
    main()
