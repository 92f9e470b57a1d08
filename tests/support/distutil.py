"""Run a test function in N fresh processes that form a real gloo group on 127.0.0.1.

``run_workers(fn, world_size, *args)`` starts ``world_size`` fresh processes, calls
``fn(rank, world_size, port, *args)`` in each (``fn`` must be a module-level function so the
child can import it), and returns the results ordered by rank. The first
worker that raises fails the test with that worker's traceback; a worker that dies without
reporting, or a run past ``timeout_s``, fails it too, and every worker is killed on the way out.

Workers describe themselves with :func:`torchrun_env` passed to ``ddpkit.init(env=...)``;
nothing in the workers writes ``os.environ``.

The processes come from a fork server that imported torch once (``multiprocessing``'s
``forkserver`` start method), not from a new interpreter each: importing torch is ~1.3 s of
CPU, and on the 2-core CI machine that import, once per rank of every multi-process test, was
a large share of the suite's time. Like spawn, no state of the test process reaches a worker:
the fork server is a fresh interpreter that only imported torch; each worker is given the
test process's ``os.environ`` of the moment (as spawn would), not the server's.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from tests.support.ports import free_port

__all__ = [
    "Indices",
    "free_port",
    "run_workers",
    "slurm_step_env",
    "torchrun_env",
]

# What the fork server imports once for every worker it forks: modules whose import leaves no
# state a worker could notice. It starts no Python thread and opens no file; the one native
# thread it starts (numpy's OpenBLAS server, idle) is shut down around a fork by OpenBLAS's own
# atfork handlers, the path every forked DataLoader worker takes. Not torch._dynamo (which the
# first DistributedDataParallel imports, ~1.5 CPU-s a rank): with it preloaded, a forked rank
# of test_checkpoint_async_ranks' guard test hung at its end in 2 of 3 CI runs (2026-12-02,
# cause not found; none in the runs before it was added).
FORKSERVER_PRELOAD = ["torch", "torch.distributed"]

# The signal that makes a worker write its threads' stacks (faulthandler's C handler, which
# works while the worker waits in torch's C++): a real-time one, which neither ddpkit (SIGUSR1,
# SIGTERM, ...), torch nor SLURM sends.
_STACKS_SIGNAL = signal.SIGRTMIN + 7


def torchrun_env(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    """The variables torchrun gives worker ``rank`` of a one-node job, plus ``extra``."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        **extra,
    }


def slurm_step_env(
    rank: int, world_size: int, job_id: str, node: str, **extra: str
) -> dict[str, str]:
    """The variables srun gives task ``rank`` of a one-node step on ``node``, plus ``extra``."""
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_TASKS": str(world_size),
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_TASKS_PER_NODE": str(world_size),
        "SLURM_STEP_NODELIST": node,
        **extra,
    }


def _entry(
    fn: Callable[..., Any],
    where: tuple[int, int, int],
    args: tuple[Any, ...],
    out: Any,
    env: dict[str, str],
    *,
    stacks: str,
) -> None:
    os.environ.clear()  # the test process's environment, as spawn gives it, not the server's
    os.environ.update(env)
    rank, world_size, port = where
    # Where this rank stands when a peer fails: _STACKS_SIGNAL writes its threads' stacks there.
    stack_file = open(Path(stacks) / f"rank{rank}.txt", "w")  # noqa: SIM115 (the process's life)
    faulthandler.register(_STACKS_SIGNAL, file=stack_file, all_threads=True)
    try:
        result = fn(rank, world_size, port, *args)
    except BaseException:
        failure = traceback.format_exc()
        out.put((rank, False, failure + _who_holds_the_peer(failure)))
    else:
        out.put((rank, True, result))


def _who_holds_the_peer(text: str) -> str:
    """For gloo's "Connection closed by peer [addr]:port": the sockets on that port and the
    command lines of their processes, read the moment it failed.

    gloo prints the port with its bytes swapped (network byte order read as a host integer:
    checked on 2026-11-29 with a 2-rank group whose rank 1 exited, rank 0's error named :14766
    for rank 1's listener on 44601), so the port looked at is the swapped one, and the ports
    it met. Seen in CI 4 times, inside ``init_process_group``: a peer that had left its own
    ``init_process_group`` early and ended its group at once (gloo's ranks are not done
    together; see ``ddpkit.worker.process_group._formed_everywhere``, which makes ``init()``
    meet the ranks, and the barrier of tests/worker/test_rankzero.py's plain group)."""
    found = re.search(r"closed by peer \[?[^\]\s]*\]?:(\d+)", text)
    if found is None:
        return ""
    printed = int(found.group(1))
    port = str(socket.ntohs(printed))
    try:
        sockets = subprocess.run(
            ["ss", "-tanpH"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"\n(ss failed: {exc})"
    lines = [line for line in sockets if re.search(rf":{port}\b", line)]
    # and the sockets of the ports those met (the listener a connection went to, its owner)
    met = set(re.findall(r":(\d+)\b", " ".join(lines))) - {port}
    lines += [
        line
        for line in sockets
        if line not in lines and any(re.search(rf":{other}\b", line) for other in met)
    ]
    commands = []
    for pid in sorted(set(re.findall(r"pid=(\d+)", "\n".join(lines)))):
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        command = raw.replace(b"\0", b" ").decode(errors="replace")[:300]
        commands.append(f"  {pid}: {command}")
    head = f"\nsockets on port {port} (gloo printed {printed}, byte-swapped) then:"
    return "\n".join([head, *lines[:30], *commands])


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """``[fn(rank, world_size, port, *args) for each rank]``, run in parallel processes."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    results_queue = context.Queue()
    port = free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="ddpkit-test-stacks-") as stacks:
        workers = [
            context.Process(
                target=_entry,
                args=(fn, (rank, world_size, port), args, results_queue, env),
                kwargs={"stacks": stacks},
                name=f"ddpkit-test-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for worker in workers:
            worker.start()
        try:
            deadline = time.monotonic() + timeout_s
            results = _collect(results_queue, workers, deadline, fn.__name__, Path(stacks))
        except BaseException:
            _stop(workers, grace_s=0.0)  # peers of a failed rank may wait forever in a collective
            raise
        _stop(workers, grace_s=10.0)
    return [results[rank] for rank in range(world_size)]


def _collect(
    results_queue: Any, workers: list[BaseProcess], deadline: float, name: str, stacks: Path
) -> dict[int, Any]:
    results: dict[int, Any] = {}
    while len(results) < len(workers):
        missing = [rank for rank in range(len(workers)) if rank not in results]
        if time.monotonic() > deadline:
            where = _the_others(results_queue, workers, missing, stacks, wait_s=0.0)
            raise AssertionError(f"{name}: ranks {missing} did not finish in time{where}")
        try:
            rank, ok, payload = results_queue.get(timeout=0.5)
        except queue.Empty:
            dead = [rank for rank in missing if not workers[rank].is_alive()]
            if dead:
                # A final look: a worker's result may land just after it exits.
                time.sleep(0.5)
                if results_queue.empty():
                    codes = {rank: workers[rank].exitcode for rank in dead}
                    raise AssertionError(f"{name}: ranks died without a result: {codes}") from None
            continue
        if not ok:
            others = [other for other in missing if other != rank]
            where = _the_others(results_queue, workers, others, stacks, wait_s=5.0)
            raise AssertionError(f"{name}: rank {rank} raised:\n{payload}{where}")
        results[rank] = payload
    return results


def _the_others(
    results_queue: Any, workers: list[BaseProcess], ranks: list[int], stacks: Path, wait_s: float
) -> str:
    """What ``ranks`` did when the test gave up on the run: the result each sent within
    ``wait_s`` (a rank that failed too may have seen the cause first), else the stacks of the
    threads of each one still running, else its exit code."""
    if not ranks:
        return ""
    seen: dict[int, str] = {}
    end = time.monotonic() + wait_s
    while len(seen) < len(ranks):
        try:
            rank, ok, payload = results_queue.get(timeout=max(0.05, end - time.monotonic()))
        except queue.Empty:
            break
        if rank in ranks:
            seen[rank] = "returned" if ok else f"raised:\n{payload}"
    # only the silent ones, once their results had time to come: the signal would end a rank
    # that has not registered its handler yet
    for rank in ranks:
        if rank not in seen and workers[rank].is_alive() and workers[rank].pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(workers[rank].pid, _STACKS_SIGNAL)
    time.sleep(0.2)  # the stacks' writes
    parts = []
    for rank in ranks:
        if rank in seen:
            parts.append(f"rank {rank} {seen[rank]}")
            continue
        code = workers[rank].exitcode
        try:
            stack = (stacks / f"rank{rank}.txt").read_text(errors="replace").strip()[-3000:]
        except FileNotFoundError:
            stack = ""
        state = "running" if code is None else f"exited with code {code}"
        parts.append(f"rank {rank} {state}, its threads:\n{stack or '(none written)'}")
    return "\n\nthe other ranks then:\n" + "\n".join(parts)


def _stop(workers: list[BaseProcess], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()


class Indices(Dataset[int]):
    """dataset[i] == i, so a batch says exactly which samples it holds."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


class CountingStore:
    """A real store whose calls are counted by name, with the most keys one call named."""

    def __init__(self, inner: object) -> None:
        self._inner, self.calls, self.most_keys = inner, {}, 0  # type: object, dict[str, int], int

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._inner, name)

        def counted(*args: object) -> object:
            self.calls[name] = self.calls.get(name, 0) + 1
            if args and isinstance(args[0], list):
                self.most_keys = max(self.most_keys, len(args[0]))
            return attr(*args)

        return counted
