"""In-process GPU checks for ci/gpu-check.sh (run under `ddpkit run --nproc-per-node 1`):
SyncBatchNorm and bf16 autocast through ``ddpkit.wrap`` under NCCL, an async checkpoint taken
from GPU memory (later in-place updates must not reach the file; it loads back bitwise), and
torch's flight recorder's view of NCCL collectives (what the hang report reads). Prints one
``ok``/``FAIL`` line per check."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit import compat
from ddpkit.errors import ConfigError


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    ctx = ddpkit.init()
    results = [check("init", ctx.device.type == "cuda" and ctx.backend == "nccl",
                     f"device {ctx.device}, backend {ctx.backend}")]  # fmt: skip
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 10)
    )
    wrapped = ddpkit.wrap(model, sync_batchnorm=True)
    inner = getattr(wrapped, "module", wrapped)
    kinds = {type(m).__name__ for m in inner.modules()}
    if ctx.world_size > 1:
        results.append(check("sync_batchnorm", "SyncBatchNorm" in kinds, str(sorted(kinds))))
    else:
        print(f"n/a  sync_batchnorm at world size 1 (wrap gave {type(wrapped).__name__})")
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.randn(16, 3, 32, 32, device=ctx.device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = wrapped(x)
        loss = out.float().square().mean()
    loss.backward()
    optimizer.step()
    results.append(check("bf16 autocast step", out.dtype == torch.bfloat16 and bool(
        torch.isfinite(loss)), f"out {out.dtype}, loss {loss.item():.4f}"))  # fmt: skip

    state = {"model": wrapped, "optimizer": optimizer}
    before = {k: v.detach().clone() for k, v in inner.state_dict().items()}
    pending = ddpkit.async_save_checkpoint(args.dir, state, step=1)
    with torch.no_grad():  # in place, right after the save returned: must not reach the file
        for p in inner.parameters():
            p.add_(1.0)
    pending.wait()
    for p in inner.parameters():
        p.data.zero_()
    step = ddpkit.load_checkpoint(args.dir, state, map_location=ctx.device)
    after = inner.state_dict()
    same = all(torch.equal(before[k], after[k]) for k in before)
    results.append(check("async checkpoint from GPU memory", step == 1 and same,
                         f"step {step}, bitwise {same}"))  # fmt: skip

    value = torch.ones(4, device=ctx.device)
    for _ in range(3):
        dist.all_reduce(value)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    results.append(check("NCCL all_reduce under the watchdog", float(value[0]) == 1.0))
    try:
        dump = compat.flight_recorder(True) or {}
        ops = [str(entry.get("profiling_name")) for entry in dump.get("entries") or []]
        recorded = "nccl:all_reduce" in ops
        results.append(check("flight recorder on NCCL", recorded, repr(ops[-4:])[:300]))
    except Exception as error:  # report, do not hide
        results.append(check("flight recorder on NCCL", False, repr(error)))
    results += mixed_group_recorders(ctx)
    results += explicit_ddp_syncbn(ctx) + split_model(ctx) + dataparallel_two_replicas_one_gpu()
    ddpkit.shutdown()
    return 0 if all(results) else 1


def mixed_group_recorders(ctx: ddpkit.Context) -> list[bool]:
    """One group over ``cpu:gloo,cuda:nccl``: its CPU collective lands in torch's generic
    recorder, its CUDA one in NCCL's, each recorder numbering groups its own way;
    ``compat.flight_recorder`` merges the two (renaming the NCCL side of a group id both use),
    and once both collectives completed the watchdog's test sees neither in flight."""
    from ddpkit.worker.watchdog import flight

    name = "flight recorders: one group over cpu:gloo,cuda:nccl, merged"
    try:
        group = dist.new_group(ranks=list(range(ctx.world_size)), backend="cpu:gloo,cuda:nccl")
        dist.all_reduce(torch.ones(3), group=group)
        dist.all_reduce(torch.ones(5, device=ctx.device), group=group)
        torch.cuda.synchronize()
        deadline = time.monotonic() + 10  # torch's NCCL watchdog marks the work completed
        while True:
            dump = compat.flight_recorder(True) or {}
            status = flight._status(dump)
            mine = [
                (str(e.get("pg_id")), e.get("profiling_name"), e.get("collective_seq_id"),
                 e.get("input_sizes"), flight._in_flight(e, status))
                for e in dump.get("entries") or []
                if e.get("input_sizes") in ([[3]], [[5]])
            ]  # fmt: skip
            if not any(row[4] for row in mine) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        names = {row[1] for row in mine}
        ok = {"gloo:all_reduce", "nccl:all_reduce"} <= names and not any(r[4] for r in mine)
        return [check(name, ok, f"status {sorted(status.items())}, entries {mine}"[:600])]
    except Exception as error:  # report, do not hide
        return [check(name, False, repr(error)[:300])]


def explicit_ddp_syncbn(ctx: ddpkit.Context) -> list[bool]:
    """strategy='ddp' at world size 1 on NCCL: SyncBatchNorm runs its collective path."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 14 * 14, 4))  # fmt: skip
    try:
        wrapped = ddpkit.wrap(model, "ddp", sync_batchnorm=True)
        kinds = {type(m).__name__ for m in wrapped.modules()}
        x = torch.randn(8, 3, 16, 16, device=ctx.device)
        wrapped(x).square().mean().backward()
        torch.cuda.synchronize()
        ok = type(wrapped).__name__ == "DistributedDataParallel" and "SyncBatchNorm" in kinds
        results = [check("SyncBatchNorm under DDP on NCCL (world 1)", ok, type(wrapped).__name__)]
        for _ in range(101):  # DDP samples its compute times (CUDA events) every 100 steps
            wrapped(x).square().mean().backward()
        compute = compat.ddp_compute_s(wrapped)
        results.append(check("DDP compute time on CUDA (straggler report)",
                             compute is not None and compute > 0, f"{compute!r} s"))  # fmt: skip
        return results
    except Exception as error:
        return [check("SyncBatchNorm under DDP on NCCL (world 1)", False, repr(error)[:300])]


class Split(nn.Module):
    """The first layer on the CPU, the rest on cuda:0."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.rest = nn.Sequential(nn.ReLU(), nn.Linear(32, 4)).to("cuda:0")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.first(x.cpu()).to("cuda:0"))


def split_model(ctx: ddpkit.Context) -> list[bool]:
    results = []
    try:  # DDP takes no module with parameters on the CPU and a GPU: refused with a hint
        ddpkit.wrap(Split(), "ddp")
        results.append(check("split model refused by strategy='ddp'", False, "not refused"))
    except ConfigError as error:
        results.append(check("split model refused by strategy='ddp'", True, str(error)[:200]))
    for strategy in ("auto", "single"):
        name = f"split CPU/cuda:0 model, wrap(strategy={strategy!r})"
        try:
            wrapped = ddpkit.wrap(Split(), strategy)
            devices = sorted({str(p.device) for p in wrapped.parameters()})
            loss = wrapped(torch.randn(8, 16)).square().mean()
            loss.backward()
            grads = all(p.grad is not None for p in wrapped.parameters())
            results.append(check(name, devices == ["cpu", "cuda:0"] and grads,
                                 f"{type(wrapped).__name__}, params on {devices}"))  # fmt: skip
        except Exception as error:
            results.append(check(name, False, repr(error)[:300]))
    return results


def dataparallel_two_replicas_one_gpu() -> list[bool]:
    """ddpkit's DataParallel + balanced loss with device_ids=[0, 0], if torch allows it."""
    from ddpkit.worker.dataparallel import DataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
    x, y = torch.randn(10, 16, device="cuda"), torch.randint(0, 4, (10,), device="cuda")
    criterion = nn.CrossEntropyLoss()
    reference = criterion(model(x), y)
    reference.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    name = "DataParallel + balanced loss, two replicas on one GPU"
    try:
        wrapper = DataParallel(model, device_ids=[0, 0], first_device_batch=3)
        loss = ddpkit.balanced_loss(wrapper, criterion)(x, y)
        loss.backward()
        got = [p.grad for p in model.parameters()]
        pairs = zip(got, want, strict=True)
        close = torch.allclose(loss, reference, atol=1e-6) and all(
            g is not None and torch.allclose(g, w, atol=1e-6) for g, w in pairs
        )
        return [check(name, close, f"loss {loss.item():.6f} vs one device "
                                   f"{reference.item():.6f}")]  # fmt: skip
    except Exception as error:  # torch may refuse a device listed twice: say so
        print(f"n/a  {name}: torch refused: {error!r}"[:400])
        return []


if __name__ == "__main__":
    sys.exit(main())
