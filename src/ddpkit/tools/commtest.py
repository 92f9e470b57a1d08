"""The communication test: an all_reduce sweep over message sizes, and what the link can do.

Reported the way nccl-tests reports it: for a message of S bytes taking t seconds,
``algbw = S / t`` and ``busbw = algbw * 2(n-1)/n`` (the bytes each rank's link carries in a
ring all_reduce of n ranks, so busbw compares with the link's own speed whatever n is). t is the
slowest rank's mean over the iterations. The references run in the same group: a memcpy of the
largest message (what a copy in memory costs, a bound for loopback) and a raw TCP transfer
between rank 0 and the last rank (one stream over the link the job actually uses; across two
nodes when the job spans them).

Needs a formed process group (the caller forms and destroys it); gloo on CPU tensors, NCCL on
CUDA tensors. Every collective is bounded by the group's timeout.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "FULL_SIZES",
    "QUICK_SIZES",
    "Row",
    "bus_factor",
    "iterations",
    "memcpy_gbps",
    "nccl_version",
    "socket_gbps",
    "sum_is_correct",
    "sweep",
]

FULL_SIZES = tuple(4 * 4**k for k in range(13))  # 4 B .. 64 MiB
QUICK_SIZES = (4, 4096, 262144, 4 * 2**20)  # 4 B, 4 KiB, 256 KiB, 4 MiB


@dataclass(frozen=True)
class Row:
    """One message size: the slowest rank's time per all_reduce and the bandwidths."""

    backend: str
    size_bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float


def nccl_version() -> str | None:
    """NCCL's version as torch was built with it (``2.21.5``), None without CUDA."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    parts = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    return ".".join(str(part) for part in parts)


def bus_factor(world_size: int) -> float:
    """nccl-tests' all_reduce factor 2(n-1)/n (0 for a world of one: nothing crosses a link)."""
    return 2 * (world_size - 1) / world_size


def iterations(size_bytes: int, quick: bool) -> int:
    """Enough iterations to average out noise, few for large messages (about 64 MiB moved)."""
    budget = 2**24 if quick else 2**26
    return max(3, min(50 if quick else 200, budget // max(size_bytes, 1)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def sweep(
    device: torch.device, sizes: tuple[int, ...], *, quick: bool = False, label: str = ""
) -> list[Row]:
    """all_reduce float32 messages of ``sizes`` bytes on ``device``; one :class:`Row` each."""
    world = dist.get_world_size()
    backend = label or str(dist.get_backend())
    rows = []
    for size in sizes:
        tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        count = iterations(size, quick)
        for _ in range(2):  # warm-up: connections, buffers
            dist.all_reduce(tensor)
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            dist.all_reduce(tensor)
        _sync(device)
        per_op = _slowest((time.perf_counter() - start) / count, device)
        algbw = tensor.numel() * 4 / per_op / 1e9
        rows.append(
            Row(backend, tensor.numel() * 4, per_op * 1e6, algbw, algbw * bus_factor(world))
        )
    return rows


def sum_is_correct(device: torch.device) -> bool:
    """all_reduce(rank + 1) gives n(n+1)/2 on every rank (each rank answers for itself)."""
    world = dist.get_world_size()
    value = torch.full((1024,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(value)
    return bool(torch.all(value == world * (world + 1) / 2).item())


def memcpy_gbps(size_bytes: int, repeats: int = 5) -> float:
    """Copy bandwidth of one ``size_bytes`` buffer in memory (best of ``repeats``), GB/s."""
    source = torch.ones(max(1, size_bytes // 4), dtype=torch.float32)
    target = torch.zeros_like(source)  # touched: no page faults inside the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return source.numel() * 4 / best / 1e9


def socket_gbps(master_addr: str, size_bytes: int, timeout_s: float) -> float | None:
    """One TCP stream from the last rank to rank 0 (``master_addr``), GB/s on rank 0.

    Collective: every rank calls it; ranks between 0 and the last only pass the barrier.
    None on a world of one. Rank 0 listens on a free port it broadcasts over the group.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return None
    last = world - 1
    server: socket.socket | None = None
    port = [0]
    if rank == 0:
        server = socket.create_server(("", 0), family=socket.AF_INET)
        server.settimeout(timeout_s)
        port = [server.getsockname()[1]]
    dist.broadcast_object_list(port, src=0)
    result = None
    try:
        if rank == 0 and server is not None:
            result = _receive(server, size_bytes)
        elif rank == last:
            _send(master_addr, port[0], size_bytes, timeout_s)
    finally:
        if server is not None:
            server.close()
    dist.barrier()
    return result


def _receive(server: socket.socket, size_bytes: int) -> float:
    conn, _ = server.accept()
    with conn:
        conn.settimeout(server.gettimeout())
        buffer = bytearray(min(size_bytes, 4 * 2**20))
        view = memoryview(buffer)
        conn.recv_into(view, 1)  # the first byte starts the clock
        start, got = time.perf_counter(), 1
        while got < size_bytes:
            n = conn.recv_into(view, min(len(buffer), size_bytes - got))
            if n == 0:
                raise ConnectionError("the sender closed early")
            got += n
        elapsed = time.perf_counter() - start
        conn.sendall(b"k")
    return size_bytes / max(elapsed, 1e-9) / 1e9


def _send(addr: str, port: int, size_bytes: int, timeout_s: float) -> None:
    with socket.create_connection((addr, port), timeout=timeout_s) as conn:
        chunk = bytes(min(size_bytes, 4 * 2**20))
        sent = 0
        while sent < size_bytes:
            piece = chunk[: size_bytes - sent]
            conn.sendall(piece)
            sent += len(piece)
        conn.recv(1)
