"""The doctor's communication step: form a group on the doctor's store, sweep, compare, leave.

One group, ``cpu:gloo`` (plus ``cuda:nccl`` where this rank has a GPU), on a prefix of the
store every rank already reached, with the doctor's timeout as the collective timeout, so a
rank that dies mid-sweep ends the step with a FAIL line instead of a hang. The group is
destroyed before returning.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]  # public, not in __all__
from torch.distributed.distributed_c10d import Store

from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.tools import commtest
from ddpkit.tools.doctor_checks import Check, DoctorOptions, Report

__all__ = ["run"]


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
    sizes = commtest.QUICK_SIZES if options.quick else commtest.FULL_SIZES
    largest = max(sizes)
    report.references["memcpy_gbps"] = commtest.memcpy_gbps(largest)
    report.references["socket_gbps"] = commtest.socket_gbps(
        info.master_addr, largest, options.timeout_s
    )
    for device in devices:
        name = "nccl" if device.type == "cuda" else "gloo"
        correct = commtest.sum_is_correct(device)
        rows = commtest.sweep(device, sizes, quick=options.quick, label=name)
        report.allreduce += [asdict(row) for row in rows]
        report.checks.append(_summary(name, info, rows, correct, report.references))


def _summary(
    name: str,
    info: RankInfo,
    rows: list[commtest.Row],
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
