"""What ``ddpkit doctor``'s ranks cost rank 0's store while they wait for its verdict.

    python benchmarks/verdict_wait.py [--window-s 4] 1024 4096

Every rank but 0 waits for rank 0's verdict for as long as rank 0 waits for the last rank to
arrive (up to the doctor's timeout). N - 1 simulated ranks (torch clients in threads, 16 to a
process forked from a server that imported torch once, as ``scalesim``) wait ``--window-s``
seconds before the store's host sets the verdict, two ways, one after the other:

* ``wait``: ddpkit's :meth:`ddpkit.tools.meeting.Meeting.wait_for` (one wait the store answers
  when the key is set, as torch's own store barrier waits);
* ``poll``: a ``check`` every 0.1 s, as ``wait_for`` did until 2026-11-28.

Prints the store's host process CPU over the window (its one thread serves every client) and
when the last rank had the verdict. A diagnostic, not a figure of the report.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scalesim

PER_PROCESS = 16


def host(port_to: Any, go: Any, done: Any, out: Any, window_s: float) -> None:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120), wait_for_workers=False)
    port_to.put(store.port)
    go.wait()
    started = time.process_time()
    time.sleep(window_s)
    store.set("verdict", "ok")
    done.wait(300)
    out.put(time.process_time() - started)


def ranks(port: int, count: int, how: str, ready: Any, go: Any, finished: Any) -> None:  # noqa: PLR0917
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from ddpkit.tools.doctor_checks import Check
    from ddpkit.tools.meeting import Meeting

    stores = [TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120))
              for _ in range(count)]  # fmt: skip
    ready.put(1)
    go.wait()

    def one(store: Any) -> None:
        if how == "poll":
            while not store.check(["verdict"]):
                time.sleep(0.1)
            store.get("verdict")
        else:
            Meeting(store, Check("PASS", "store", "ok"), 1, 2, 120.0).wait_for("verdict", 120.0)

    threads = [threading.Thread(target=one, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    finished.put(time.monotonic())


def run(world: int, how: str, window_s: float) -> dict[str, Any]:
    ctx = scalesim.context()
    port_to, ready, finished, out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    go, done = ctx.Event(), ctx.Event()
    store_host = ctx.Process(target=host, args=(port_to, go, done, out, window_s))
    store_host.start()
    port = port_to.get(timeout=120)
    counts = [min(PER_PROCESS, world - 1 - i) for i in range(0, world - 1, PER_PROCESS)]
    holders = [ctx.Process(target=ranks, args=(port, n, how, ready, go, finished)) for n in counts]
    for holder in holders:
        holder.start()
    for _ in holders:
        ready.get(timeout=600)
    set_at = time.monotonic() + window_s
    go.set()
    last = max(finished.get(timeout=600) for _ in holders)
    done.set()
    cpu_s = out.get(timeout=60)
    for process in [*holders, store_host]:
        process.join(30)
    return {"N": world, "how": how, "store_cpu_s": round(cpu_s, 3), "window_s": window_s,
            "store_busy": round(cpu_s / window_s, 3),
            "last_had_it_s": round(last - set_at, 3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", type=int, nargs="+")
    parser.add_argument("--window-s", type=float, default=4.0)
    args = parser.parse_args()
    print(scalesim.resolver_answers(), flush=True)
    scalesim.raise_fd_limit()
    for world in args.sizes:
        for how in ("wait", "poll"):
            print(json.dumps(run(world, how, args.window_s)), flush=True)


if __name__ == "__main__":
    main()
