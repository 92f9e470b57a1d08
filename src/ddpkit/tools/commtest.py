"""The communication test: an all_reduce sweep over message sizes, and what the link can do.

Reported the way nccl-tests reports it: for a message of S bytes taking t seconds,
``algbw = S / t`` and ``busbw = algbw * 2(n-1)/n`` (the bytes each rank's link carries in a
ring all_reduce of n ranks, so busbw compares with the link's own speed whatever n is). t is the
slowest rank's mean over the iterations. The references run in the same group: a memcpy of the
largest message (what a copy in memory costs, a bound for loopback) and a raw TCP transfer
between rank 0 and the last rank (one stream over the link the job actually uses; across two
nodes when the job spans them).

The measurements need a formed process group; gloo on CPU tensors, NCCL on CUDA tensors.
The doctor's communication step (:func:`run`) forms one, ``cpu:gloo`` (plus ``cuda:nccl`` where
this rank has a GPU), on a prefix of the store every rank already reached, with the doctor's
timeout as the collective timeout, so a rank that dies mid-sweep ends the step with a FAIL line
instead of a hang; the group is destroyed before it returns.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]  # public, not in __all__
from torch.distributed.distributed_c10d import Store

from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.tools.doctor_checks import Check, DoctorOptions, Report

__all__ = [
    "FULL_SIZES",
    "QUICK_SIZES",
    "Row",
    "bus_factor",
    "iterations",
    "memcpy_gbps",
    "nccl_version",
    "run",
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


def run(report: Report, info: RankInfo, store: Store, options: DoctorOptions) -> None:
    """Append the sweep's check line(s), rows and references to ``report``."""
    cuda = torch.cuda.is_available()
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    devices = [torch.device("cpu")] + ([torch.device("cuda", _gpu(info))] if cuda else [])
    if cuda:
        torch.cuda.set_device(devices[1])
    try:
        dist.init_process_group(
            backend,
            store=PrefixStore("pg", store),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timedelta(seconds=options.timeout_s),
        )
    except (RuntimeError, dist.DistError) as exc:
        report.checks.append(_failed("all_reduce", exc, options.timeout_s))
        return
    try:
        _measure(report, info, devices, options)
    except (RuntimeError, dist.DistError, OSError) as exc:
        report.checks.append(_failed("all_reduce", exc, options.timeout_s))
    finally:
        dist.destroy_process_group()


def _gpu(info: RankInfo) -> int:
    count = torch.cuda.device_count()
    return info.local_rank if count >= info.local_world_size else 0


def _measure(
    report: Report, info: RankInfo, devices: list[torch.device], options: DoctorOptions
) -> None:
    sizes = QUICK_SIZES if options.quick else FULL_SIZES
    largest = max(sizes)
    report.references["memcpy_gbps"] = memcpy_gbps(largest)
    report.references["socket_gbps"] = socket_gbps(info.master_addr, largest, options.timeout_s)
    for device in devices:
        name = "nccl" if device.type == "cuda" else "gloo"
        correct = sum_is_correct(device)
        rows = sweep(device, sizes, quick=options.quick, label=name)
        report.allreduce += [asdict(row) for row in rows]
        report.checks.append(_summary(name, info, rows, correct, report.references))


def _summary(
    name: str,
    info: RankInfo,
    rows: list[Row],
    correct: bool,
    references: dict[str, float | None],
) -> Check:
    check = f"all_reduce {name}"
    if not correct:
        wrong = f"all_reduce over {info.world_size} ranks gave a wrong sum"
        hint = "a broken backend or mixed versions; run `ddpkit env` on each node"
        return Check("FAIL", check, wrong, hint)
    socket_ref = references.get("socket_gbps")
    memcpy = references.get("memcpy_gbps") or 0
    head = (
        f"{info.world_size} ranks on {info.num_nodes} node(s), sum correct; latency "
        f"{rows[0].time_us:.0f} us at {rows[0].size_bytes} B"
    )
    if info.world_size < 2:
        # busbw is 0 and algbw only measures a local no-op: no figure worth a "peak"
        detail = f"{head}; one rank: nothing crosses a link, memcpy {memcpy:.2f} GB/s"
        return Check("PASS", check, detail)
    best = max(rows, key=lambda r: r.busbw_gbps)
    link = f"raw socket {socket_ref:.2f} GB/s" if socket_ref else "no raw-socket reference"
    detail = (
        f"{head}; peak busbw {best.busbw_gbps:.3f} GB/s (algbw {best.algbw_gbps:.3f} GB/s) at "
        f"{best.size_bytes} B; {link}, memcpy {memcpy:.2f} GB/s"
    )
    return Check("PASS", check, detail)


def _failed(check: str, exc: BaseException, timeout_s: float) -> Check:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return Check(
        "FAIL",
        check,
        f"{type(exc).__name__}: {first[:300]}",
        f"a rank died or stalled (the bound is --timeout {timeout_s:g} s); see each rank's output",
    )
