"""In-process GPU checks for ci/gpu-check.sh (run under `ddpkit run --nproc-per-node 1`):
SyncBatchNorm and bf16 autocast through ``ddpkit.wrap`` under NCCL, an async checkpoint taken
from GPU memory (later in-place updates must not reach the file; it loads back bitwise), and
the hang record's view of NCCL collectives. Prints one ``ok``/``FAIL`` line per check."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ddpkit


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
        from ddpkit.worker.watchdog import record

        installed = record.installed()
        tail = installed.tail() if installed is not None and hasattr(installed, "tail") else None
        if ctx.world_size > 1:
            results.append(check("hang record on NCCL", installed is not None, repr(tail)[:300]))
        else:
            print("n/a  hang record at world size 1 (no watchdog without peers)")
    except Exception as error:  # report, do not hide
        results.append(check("hang record on NCCL", False, repr(error)))
    ddpkit.shutdown()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
