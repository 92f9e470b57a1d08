"""Every survivor of a failed collective looks for the peer that left at once: who names whom.

    python benchmarks/hurry_probe.py 64 1024

The simulated ranks of ``bench_scale.py`` (:mod:`scalesim`, 16 to a process, ddpkit's own
watchdog links) come up; a few beat intervals later one rank's link stops (a rank killed, no
marker), and 0.3 s after, every other rank's link is hurried as a failed collective's
excepthook hurries it and waits for the cause (``Watchdog._wait_for_cause`` itself, with no
marker to find: up to 2.5 s, 5 s while the answer may still come). Prints how many named the
stopped rank, another rank ("wrong:<rank>"), nobody ("none") or did not know in time
("unknown"), how long they took, and the CPU the store's thread spent meanwhile. A
diagnostic, not a figure of the report.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scalesim

from ddpkit.worker.watchdog import Watchdog
from ddpkit.worker.watchdog.policy import beat_interval_for, hook_wait_for, interval_for

VICTIM = 5


def judge(sim: scalesim.Rank, started: float) -> tuple[str, float]:
    """What a failed collective's excepthook finds on this rank: (outcome, seconds)."""
    assert sim.link is not None
    watchdog = Watchdog(sim.link.link, bound_s=sim.bound_s, clock=time.monotonic)
    cause = watchdog._wait_for_cause(hook_wait_for(interval_for(sim.bound_s)))
    took = time.monotonic() - started
    if cause is not None:
        return ("victim" if cause.rank == VICTIM else f"wrong:{cause.rank}"), took
    return ("none" if sim.link.silent() == [] else "unknown"), took


def worker(ranks: list[int], world: int, port: int, events: Any, out: Any) -> None:
    go, kill, fail = events
    sims, threads, line = scalesim.loaded(ranks, world, port, "ddpkit")
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
        got = judge(sim, started)
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
    print(scalesim.resolver_answers(), flush=True)
    procs = max(1, world // 16)
    ctx = scalesim.context()
    port = scalesim.listen_port()
    events = (ctx.Event(), ctx.Event(), ctx.Event())
    out: Any = ctx.Queue()
    children = [
        ctx.Process(target=worker, args=(c, world, port, events, out))
        for c in scalesim.chunks(world, procs)
    ]
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
    results = [judge(rank0, started)]
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
