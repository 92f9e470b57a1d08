"""How the control plane's cost grows with the job: 2 -> 4096 simulated ranks on one store.

    python benchmarks/bench_scale.py [--max-ranks 4096] [--procs 2] [--ranks-per-proc 16]
        [--runs 3] [--startup-runs 9] [--startup-max 1024] [--window-s 3] [--quick]
        [--json FILE]

Each simulated rank is a thread with its own store client doing what a rank does against the
rendezvous store (:mod:`scalesim`: ddpkit's own rendezvous and watchdog code, beside plain
torch's ``env://`` store rendezvous, and ddpkit's rendezvous alone, its watchdog off), rank 0
in this process hosting the store, the others spread over ``--procs`` processes, more when that
would put over ``--ranks-per-proc`` ranks in one (a real rank has its process, and its GIL, to
itself; the ranks of one interpreter queue for its GIL at every return from C++: 256 to a
process at 2,048-4,096 ranks, the queue, not the store, set the pace, up to 494 s at 4,096).
The processes are forked from a server that imported torch once (:func:`scalesim.context`),
and every rank's thread is started and held at the line before the let-go
(:func:`scalesim.held`). Per world size N, the three variants run in turn (in the reverse
order the next trial), with the same layout: ``--runs`` trials with a heartbeat window, and up
to ``--startup-runs`` in all to ``--startup-max`` ranks, the extra ones of the start-up only
(its figures, not the window's):

* time to ready: from the moment every rank is let go until the last one is ready (where
  ``init()`` / ``init_process_group`` returns on it);
* watchdog up (ddpkit): until the last rank's watchdog has its own connection and has
  introduced itself (``init()`` does not wait for it: a rank introduces itself as its
  watchdog starts, and connects at its first beat's phase of the beat interval, 8 s at 4,096
  ranks; rank 0 at its first judging round, 1 s in);
* store calls per rank during start-up, and connections per rank;
* store host CPU per rank: the CPU time of rank 0's store server thread (torch's libuv loop,
  the one resource every rank shares) from its start until every rank is ready (init()'s burst,
  and what came before it: rank 0's own connection and calls), over N. The watchdog's own
  connections come later, each at its rank's phase, among the first heartbeats: what each costs
  the store is a figure apart, store host CPU per connection, against a torch client's
  (``connection_cost``);
* client CPU per rank: the CPU time of the processes holding the other ranks from the let-go
  until each process's ranks are ready, over N - 1 (a real rank spends it on its own node;
  here every rank's shares this machine's 2 cores, which is what bounds time to ready past
  ~1,000 ranks); the watchdog's own connection, made later, apart: its thread's CPU time from
  setting out to connect until connected, over N - 1 (the heartbeats that follow are the
  watchdog's load, not its start-up; a rank whose phase comes before its process's last rank
  is ready connects inside the first span too: counted in both);
* watchdog load: store calls (and keys named) per second at the store once every rank is up,
  over ``--window-s`` rounded up to whole beat intervals (the interval grows past 512 ranks;
  each rank beats once an interval, so a window of whole intervals holds the same number of
  beats of every rank) (plain torch has no watchdog: nothing);
* watchdog burst: over the same window, the most store calls that reached the store in one
  0.1 s slot, over the mean of the window's slots (1: spread evenly over the beat interval;
  the number of slots: every rank at once);
* listen queue overflows: connects the kernel dropped because the store's listen queue was
  full (``ListenOverflows`` in /proc/net/netstat, the whole machine's, from the let-go until
  every rank is up; each is retried only after the SYN back-off, 1 s);
* rank 0's judging round: once an interval rank 0's watchdog reads every rank's beat counter
  from the store its one thread serves every rank with; timed up to 98,304 ranks (torch's
  published 96K) on one store in this process, against one torch ``multi_get`` of the same
  keys and a Python loop over the counters, the judgment written plainly (the multi_get's
  cost grows faster than N: ddpkit reads a slice of keys a call, and compares in C's loops);
* stop agreement: ``PreemptionGuard.should_stop()`` (an all_reduce, no store call) against a
  plain ``dist.all_reduce`` of the same flag, real gloo processes with ``ddpkit.init()``, at
  the world sizes this machine runs as processes (2..8; 2..4 with ``--quick``).

The growth of each figure with N is fitted (the slope of log(value) against log(N)) and named:
constant, log, linear or worse than linear.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchjson
import scalesim

from ddpkit.worker.watchdog.policy import beat_interval_for

DDPKIT, PLAIN = "ddpkit (rendezvous + watchdog)", "plain torch (env:// TCPStore)"
# the same with the watchdog off: what of ddpkit's cost is its rendezvous, what its watchdog
RENDEZVOUS = "ddpkit (rendezvous only, watchdog off)"
KINDS = {DDPKIT: "ddpkit", RENDEZVOUS: "ddpkit-rendezvous", PLAIN: "plain"}
STOP_DDPKIT, STOP_PLAIN = "ddpkit PreemptionGuard.should_stop", "plain dist.all_reduce(MAX)"
JUDGE_DDPKIT = "ddpkit watchdog (a multi_get a slice of keys)"
JUDGE_PLAIN = "plain torch (one multi_get of every key, a Python loop)"
JUDGE_FIGURE = "rank 0's judging round (every beat counter read once)"
CONNECT_DDPKIT = "ddpkit watchdog's own connection (a new client)"
CONNECT_PLAIN = "plain torch client (TCPStore)"
CONNECT_FIGURE = "store host CPU per connection (opened and closed)"


def worker(job: tuple[list[int], int, int, str], events: Any, out: Any) -> None:
    """A process of simulated ranks: start them, report readiness, tally the heartbeat window."""
    ranks, world, port, variant = job
    go, window, finish = events
    sims, threads, line = scalesim.loaded(ranks, world, port, variant)
    out.put(("loaded", None))
    go.wait()
    cpu_before = time.process_time()
    line.set()
    for sim in sims:  # each returns from init(): the parent reads the store's CPU then
        sim.readied.wait()
    cpu_s = time.process_time() - cpu_before  # every rank of this process, until all were ready
    out.put(("init", None))
    for thread in threads:
        thread.join()
    # the watchdog's own connections, made later (its thread's CPU, from "linked" to "cloned")
    link_s = sum(sim.cpu["cloned"] - sim.cpu["linked"] for sim in sims if "cloned" in sim.cpu)
    errors = [sim.error for sim in sims if sim.error]
    ready = max((sim.ready_at or math.inf for sim in sims), default=0.0)
    up = max((sim.up_at or 0.0 for sim in sims), default=0.0)
    setup = [sim.setup_calls for sim in sims]
    connections = scalesim.TALLY.snapshot()["connections"]
    body = {"ready_at": ready, "up_at": up, "errors": errors[:3], "calls": sum(setup),
            "max_calls": max(setup), "connections": connections, "cpu_s": cpu_s,
            "link_s": link_s}  # fmt: skip
    out.put(("ready", body))
    window.wait()
    first = scalesim.TALLY.snapshot()
    finish.wait()
    out.put(("window", {"first": first, "last": scalesim.TALLY.snapshot()}))
    scalesim.stop_links(sims)
    out.put(("done", None))


def total(tallies: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(store calls, keys named, connections) summed over processes."""
    calls = sum(sum(t["calls"].values()) for t in tallies)
    return calls, sum(t["keys"] for t in tallies), sum(t["connections"] for t in tallies)


def job(world: int, variant: str, procs: int, window_s: float | None) -> dict[str, float]:
    """One simulated job of ``world`` ranks: its figures (``window_s`` None: the start-up's
    only, no heartbeat window)."""
    ctx = scalesim.context()
    port = scalesim.listen_port()
    events = (ctx.Event(), ctx.Event(), ctx.Event())
    out: Any = ctx.Queue()
    children = [
        ctx.Process(target=worker, args=((c, world, port, variant), events, out))
        for c in scalesim.chunks(world, procs)
    ]
    for child in children:
        child.start()
    messages: dict[str, list[Any]] = {}

    def expect(kind: str) -> list[Any]:
        while len(messages.get(kind, [])) < len(children):
            got, body = out.get(timeout=900)
            messages.setdefault(got, []).append(body)
        return messages[kind]

    expect("loaded")
    before = scalesim.TALLY.snapshot()
    rank0 = scalesim.Rank(0, world, port, variant)
    host = threading.Thread(target=rank0.run, daemon=True)  # plain: waits for every client
    # The store's CPU from its thread's start: read once it listened, rank 0's own first calls
    # (it runs on) and the listen probe's close landed before or after the read, two groups of
    # trials 0.1 ms a rank apart at 2 ranks, whatever the variant
    store_cpu = scalesim.store_threads_cpu()
    host.start()
    scalesim.wait_listening(port)
    overflows = scalesim.listen_overflows()
    start = time.monotonic()
    events[0].set()
    expect("init")
    rank0.readied.wait(600)
    store_ready_s = scalesim.store_cpu_since(store_cpu)
    ready = expect("ready")
    host.join(600)
    overflows = scalesim.listen_overflows() - overflows
    store_cpu_s = scalesim.store_cpu_since(store_cpu)
    errors = [e for body in ready for e in body["errors"]] + ([rank0.error] if rank0.error else [])
    if errors or rank0.ready_at is None:
        raise RuntimeError(f"{variant} at N={world}: {errors[:3] or 'rank 0 not ready'}")
    ready_s = max([body["ready_at"] for body in ready] + [rank0.ready_at]) - start
    up_s = max([body["up_at"] for body in ready] + [rank0.up_at or 0.0]) - start
    calls = sum(body["calls"] for body in ready) + rank0.setup_calls
    connections = sum(body["connections"] for body in ready)
    connections += scalesim.TALLY.snapshot()["connections"] - before["connections"]
    events[1].set()
    first = scalesim.TALLY.snapshot()
    window_from = time.monotonic()
    if window_s is not None:
        beat_s = beat_interval_for(rank0.bound_s, world)  # whole beat intervals: each rank
        window_s = math.ceil(window_s / beat_s - 1e-9) * beat_s  # beats once an interval
        time.sleep(window_s)
    events[2].set()
    window_to = time.monotonic()
    last = scalesim.TALLY.snapshot()
    bodies = expect("window")
    window = [_minus(body["last"], body["first"]) for body in bodies]
    beat_calls, beat_keys, _ = total([*window, _minus(last, first)])
    burst = peak_over_mean([body["last"]["slots"] for body in bodies] + [last["slots"]],
                           window_from, window_to)  # fmt: skip
    expect("done")
    for child in children:
        child.join(30)
    scalesim.stop_links([rank0])
    beats = {}
    if window_s is not None:
        beats = {
            "beat_calls_s": beat_calls / window_s,
            "beat_keys_s": beat_keys / window_s,
            "beat_burst": burst if variant == "ddpkit" else 0.0,
        }
    return {
        "ready_s": ready_s,
        "up_s": up_s if variant == "ddpkit" else 0.0,
        "store_ready_ms": 1e3 * store_ready_s / world,
        "store_cpu_ms": 1e3 * store_cpu_s / world,
        "client_cpu_ms": 1e3 * sum(body["cpu_s"] for body in ready) / max(1, world - 1),
        "link_cpu_ms": 1e3 * sum(body["link_s"] for body in ready) / max(1, world - 1),
        "calls_per_rank": calls / world,
        "connections_per_rank": connections / world,
        "rank0_calls": float(rank0.setup_calls),
        "max_other_calls": float(max(body["max_calls"] for body in ready)),
        "overflows": float(overflows),
        **beats,
    }


def peak_over_mean(slots: list[dict[int, int]], start: float, end: float) -> float:
    """The most store calls in one slot (``scalesim.SLOT_S``) of the whole slots between
    ``start`` and ``end`` (monotonic), over their mean: 1 for calls spread evenly, up to the
    number of slots when every call comes at once. 0 when there were none. The slots cut by
    ``start`` and ``end`` count: the watchdog's ranks beat together, once an interval, and a
    window of whole intervals can begin and end at a beat (only whole slots were counted, and
    a 1-s window of 8 ranks read 0)."""
    first, last = math.floor(start / scalesim.SLOT_S), math.ceil(end / scalesim.SLOT_S)
    counts = [0] * max(0, last - first)
    for tally in slots:
        for slot, calls in tally.items():
            if first <= int(slot) < last:
                counts[int(slot) - first] += calls
    total_calls = sum(counts)
    return max(counts) * len(counts) / total_calls if total_calls else 0.0


def _minus(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    calls = {op: n - before["calls"].get(op, 0) for op, n in after["calls"].items()}
    return {
        "calls": calls,
        "keys": after["keys"] - before["keys"],
        "connections": after["connections"] - before["connections"],
    }


# --- rank 0's judging round: one store, the beat counters of a large world -----------------


def connection_cost(count: int, trials: int) -> dict[str, list[float]]:
    """Microseconds of the store server thread's CPU per connection opened and closed: the
    watchdog's own (``rendezvous.store.own_connection``: a new client of the group's store, its
    timeout set) against a torch client's (``TCPStore(..., is_master=False)``, what every plain rank
    opens), ``count`` of each a trial, alternating, on a real store in this process. What a
    rank's watchdog costs the store at start-up besides its introduction (one ``set``), now
    outside init()'s burst: bench_scale's jobs time that burst, not this."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from ddpkit.worker.rendezvous.store import own_connection

    host = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=600), wait_for_workers=False)
    client = TCPStore("127.0.0.1", host.port, None, False, timedelta(seconds=600))

    def own() -> Any:
        return own_connection(client, "w", 10.0)

    def plain() -> Any:
        return TCPStore("127.0.0.1", host.port, None, False, timedelta(seconds=600))

    found: dict[str, list[float]] = {CONNECT_DDPKIT: [], CONNECT_PLAIN: []}
    for trial in range(trials):
        order = (
            (CONNECT_DDPKIT, CONNECT_PLAIN) if trial % 2 == 0 else (CONNECT_PLAIN, CONNECT_DDPKIT)
        )
        for variant in order:
            make = own if variant == CONNECT_DDPKIT else plain
            before = scalesim.store_threads_cpu()
            for _ in range(count):
                made = make()
                assert made is not None, "the watchdog could not connect to the store"
                del made  # closed: the store's side of a connection's end is counted too
            time.sleep(0.05)  # the store's loop sees the last close
            found[variant].append(1e6 * scalesim.store_cpu_since(before) / count)
    return found


def judging_round(sizes: list[int], trials: int) -> dict[str, dict[int, list[float]]]:
    """Milliseconds of one judging round of rank 0's watchdog (every beat counter read and
    compared: ``StoreLink._check_beats``) against one torch ``multi_get`` of the same keys,
    alternating, on a real store in this process (as rank 0 hosts it; its one thread serves
    every rank meanwhile). The counters do not move: no rank is named within the bound."""
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    from ddpkit.worker.rendezvous import batched
    from ddpkit.worker.watchdog.store import StoreLink

    host = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=600), wait_for_workers=False)
    client = TCPStore("127.0.0.1", host.port, None, False, timedelta(seconds=600))
    found: dict[str, dict[int, list[float]]] = {JUDGE_DDPKIT: {}, JUDGE_PLAIN: {}}
    for n in sizes:
        prefix = f"judge/{n}"  # PrefixStore adds the "/"
        keys = [f"{prefix}/beat/{rank}" for rank in range(n)]
        batched.multi_set(client, keys, ["0"] * n)
        link = StoreLink(PrefixStore(prefix, client), rank=0, world_size=n, interval_s=1.0,
                         bound_s=3600.0, host_rank=0, address="", clock=time.monotonic)  # fmt: skip
        link._check_beats(0.0)  # the first round: every counter counts from now
        beats: dict[int, tuple[int, float]] = {}
        plain_round(client, keys, beats, 0.0)
        for trial in range(trials):
            order = (JUDGE_DDPKIT, JUDGE_PLAIN) if trial % 2 == 0 else (JUDGE_PLAIN, JUDGE_DDPKIT)
            for variant in order:
                start = time.perf_counter()
                if variant == JUDGE_DDPKIT:
                    link._check_beats(float(trial + 1))
                else:  # the same judgment written plainly (as ddpkit's was until 2026-11-27)
                    plain_round(client, keys, beats, float(trial + 1))
                found[variant].setdefault(n, []).append(1e3 * (time.perf_counter() - start))
            print(f"judging round N={n}: " + ", ".join(
                f"{v} {found[v][n][-1]:.1f} ms" for v in order), flush=True)  # fmt: skip
    return found


def plain_round(
    store: Any, keys: list[str], beats: dict[int, tuple[int, float]], now: float
) -> None:
    """One multi_get of every counter, then which moved and which stood still for the bound."""
    for rank, value in enumerate(int(raw) for raw in store.multi_get(keys)):
        last = beats.get(rank)
        if last is None or last[0] != value:
            beats[rank] = (value, now)
        elif now - last[1] >= 3600.0:
            raise AssertionError(f"rank {rank} judged gone within the bench")


# --- the stop agreement: real gloo processes ------------------------------------------------


def agree(rank: int, world: int, port: int, calls: int, trials: int, out: Any) -> None:  # noqa: PLR0917
    """One rank: ``ddpkit.init()``, then timed stop agreements, ddpkit's and plain, alternating."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import torch
    import torch.distributed as dist

    import ddpkit

    ddpkit.init(backend="gloo")
    guard = ddpkit.preemption_guard()
    times: dict[str, list[float]] = {STOP_DDPKIT: [], STOP_PLAIN: []}
    for trial in range(trials):
        order = (STOP_DDPKIT, STOP_PLAIN) if trial % 2 == 0 else (STOP_PLAIN, STOP_DDPKIT)
        for variant in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                if variant == STOP_DDPKIT:
                    guard.should_stop()
                else:  # what a script without ddpkit does to decide: the flag's value read
                    flag = torch.tensor([0], dtype=torch.int32)
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    bool(flag.item())
            slowest = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[variant].append(float(slowest.item()) * 1e6)
    if rank == 0:
        out.put(times)
    ddpkit.shutdown()


def stop_agreement(world: int, calls: int, trials: int = 16) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    port = scalesim.listen_port()
    children = [ctx.Process(target=agree, args=(r, world, port, calls, trials, out))
                for r in range(world)]  # fmt: skip
    for child in children:
        child.start()
    times: dict[str, list[float]] = out.get(timeout=600)
    for child in children:
        child.join(60)
    return times


# --- fit, figures, report ---------------------------------------------------------------------


def growth(points: list[tuple[float, float]]) -> str:
    """The name of the growth of ``value`` with N: the slope of log(value) on log(N)."""
    points = [(n, v) for n, v in points if v > 0]
    if len(points) < 3:
        return "too few points"
    xs, ys = [math.log(n) for n, _ in points], [math.log(v) for _, v in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    if slope < 0.1:
        name = "constant"
    elif slope < 0.5:
        name = "about log N"
    elif slope < 1.15:
        name = "linear"
    else:
        name = "worse than linear"
    return f"{name} (log-log slope {slope:.2f})"


FIGURES = [  # key, figure, unit, higher is better
    ("ready_s", "time to ready", "s", False),
    ("up_s", "watchdog up (every rank connected and introduced)", "s", False),
    ("store_ready_ms", "store host CPU per rank, until every rank is ready", "ms", False),
    (
        "client_cpu_ms",
        "client CPU per rank, until every rank is ready (simulated ranks)",
        "ms",
        False,
    ),
    ("link_cpu_ms", "the watchdog's own connection, its thread's CPU per rank", "ms", False),
    ("calls_per_rank", "store calls per rank, start-up (mean)", "calls", False),
    ("rank0_calls", "store calls of rank 0, start-up", "calls", False),
    ("max_other_calls", "store calls of any other rank, start-up (max)", "calls", False),
    ("connections_per_rank", "store connections per rank", "connections", False),
    ("beat_calls_s", "watchdog load at the store", "calls/s", False),
    ("beat_keys_s", "watchdog keys read or written at the store", "keys/s", False),
    ("beat_burst", "watchdog burst at the store (most calls in 0.1 s, over the mean)", "x", False),
    ("overflows", "listen queue overflows, start-up", "connects dropped", False),
]


def figures(results: dict[str, dict[int, list[dict[str, float]]]]) -> tuple[list[Any], list[str]]:
    rows, notes = [], []
    for key, figure, unit, higher in FIGURES:
        for variant, by_n in results.items():
            # the start-up's extra trials have no heartbeat window, no figure of the window
            kept = {n: [t[key] for t in trials if key in t] for n, trials in by_n.items()}
            medians = [(n, statistics.median(trials)) for n, trials in kept.items()]
            if not any(value for _, value in medians):  # plain torch has none: no line at 0
                notes.append(f"{figure}, {variant}: 0 at every N")
                continue
            for n, value in medians:
                rows.append(
                    benchjson.row(figure, variant, value, unit, higher, x=n, trials=kept[n])
                )
            notes.append(f"{figure}, {variant}: {growth(medians)}")
    return rows, notes


def print_table(results: dict[str, dict[int, list[dict[str, float]]]]) -> None:
    keys = [key for key, *_ in FIGURES]
    print(f"{'variant':<32} {'N':>5} " + " ".join(f"{k:>20}" for k in keys))
    for variant, by_n in results.items():
        for n, trials in by_n.items():
            values = [statistics.median([t[k] for t in trials if k in t] or [0.0]) for k in keys]
            print(f"{variant:<32} {n:>5} " + " ".join(f"{v:>20.4g}" for v in values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchjson.add_arguments(parser)
    parser.add_argument("--max-ranks", type=int, default=4096)
    parser.add_argument("--procs", type=int, default=2, help="processes holding the ranks")
    parser.add_argument("--ranks-per-proc", type=int, default=16, help="at most, per process")
    parser.add_argument("--runs", type=int, default=3, help="trials per N (order alternates)")
    # 3 trials: a level figure is flagged (worse in 3 of 3, the report's 80% rule) 12.5% of the
    # time at each N, and the start-up figures have 16 N x variant pairs each: a size or two
    # flagged in most runs by chance (store CPU at 2, 32 or 1,024 ranks in turn). 9 trials of the
    # start-up (8 of 9 to flag: 2%) where a job is cheap; the heartbeat window's figures, 3.
    parser.add_argument("--startup-runs", type=int, default=9, help="start-up trials per N")
    parser.add_argument("--startup-max", type=int, default=1024, help="largest N with them")
    parser.add_argument("--window-s", type=float, default=3.0, help="heartbeat window")
    parser.add_argument("--stop-max", type=int, default=8, help="largest real gloo group")
    # 16 trials, not 6: two identical loops are the worse one in 5 of 6 trials (the report's
    # 80% rule) 10.9% of the time at each size; in 13 of 16, 1.1% (as bench_allreduce)
    parser.add_argument("--stop-trials", type=int, default=16, help="stop agreement trials")
    parser.add_argument("--judge-max", type=int, default=98304, help="largest judged world")
    args = parser.parse_args()
    if args.quick:
        args.max_ranks, args.runs, args.window_s, args.stop_max = 64, 1, 2.0, 4
        args.startup_runs = 2
        args.judge_max = 4096
    resolver = scalesim.resolver_answers()  # may run this again, in a namespace of its own
    print(resolver, flush=True)
    scalesim.raise_fd_limit()
    scalesim.instrument()
    sizes = [n for n in (2, 8, 32, 128, 512, 1024, 2048, 4096) if n <= args.max_ranks]
    results: dict[str, dict[int, list[dict[str, float]]]] = {v: {} for v in KINDS}
    for n in sizes:
        runs = max(args.runs, args.startup_runs if n <= args.startup_max else 0)
        for trial in range(runs):
            order = list(KINDS) if trial % 2 == 0 else list(reversed(KINDS))
            window_s = args.window_s if trial < args.runs else None  # the start-up's only
            for variant in order:
                procs = max(args.procs, math.ceil((n - 1) / args.ranks_per_proc))
                found = job(n, KINDS[variant], procs, window_s)
                results[variant].setdefault(n, []).append(found)
                print(f"N={n} {variant}: {found}", flush=True)
    print_table(results)
    rows, notes = figures(results)
    notes.insert(0, resolver)
    stops: dict[str, list[tuple[float, float]]] = {STOP_DDPKIT: [], STOP_PLAIN: []}
    calls, stop_trials = (20, 2) if args.quick else (100, args.stop_trials)
    for n in [n for n in (2, 4, 8, 16) if n <= args.stop_max]:
        for variant, trials in stop_agreement(n, calls, stop_trials).items():
            value = statistics.median(trials)
            stops[variant].append((n, value))
            rows.append(benchjson.row("stop agreement (one should_stop)", variant, value, "us",
                                      False, x=n, trials=trials))  # fmt: skip
            print(f"stop agreement N={n} {variant}: {value:.0f} us", flush=True)
    notes += [f"stop agreement, {variant}: {growth(points)}" for variant, points in stops.items()]
    judged = [n for n in (1024, 4096, 16384, 32768, 98304) if n <= args.judge_max]
    for variant, by_n in judging_round(judged, args.runs).items():
        points = [(n, statistics.median(trials)) for n, trials in by_n.items()]
        for (n, value), trials in zip(points, by_n.values(), strict=True):
            rows.append(benchjson.row(JUDGE_FIGURE, variant, value, "ms", False, x=n,
                                      trials=trials))  # fmt: skip
        notes.append(f"{JUDGE_FIGURE}, {variant}: {growth(points)}")
    # 16 trials (~6 s), as the stop agreement: with 6, a level pair was flagged (5 of 6 worse)
    # 11% of the time; the one run second in a trial mostly costs the store more (2-5 us, cause
    # not looked into), which the alternating order spreads evenly over both
    connect_trials = 2 if args.quick else 16
    for variant, trials in connection_cost(200 if args.quick else 1000, connect_trials).items():
        value = statistics.median(trials)
        rows.append(benchjson.row(CONNECT_FIGURE, variant, value, "us", False, trials=trials))
        print(f"{CONNECT_FIGURE}, {variant}: {value:.1f} us", flush=True)
    for note in notes:
        print(note)
    benchjson.write(args.json, "scale", "Control plane against world size: simulated ranks on "
                    "one store (threads), and the stop agreement on real gloo processes",
                    "python", rows, notes=notes)  # fmt: skip


if __name__ == "__main__":
    main()
