"""The loop's features on CUDA for ci/gpu-check.sh (issue 49), under ``ddpkit run
--nproc-per-node 1``: bf16 autocast, fp16 with its GradScaler through a checkpoint (saved,
resumed), ``wrap(compile=True)``, FSDP2 at world 1 with a sharded checkpoint saved on the GPU
and loaded on the CPU (a fresh process with no GPU and no process group), and
``ddpkit.accumulate``. Each check compares against a reference computed here (an uninterrupted
run, eager, one batch of the window's rows) and prints one ``ok``/``FAIL`` line.

``--cpu-dry`` runs the same checks on CPU with gloo (compile with the ``aot_eager`` backend:
no C++ compiler needed), so that their logic runs where no GPU is lent.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ddpkit
from ddpkit.worker.state_dict import unwrap

ROWS = 12


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


class Block(nn.Module):
    """A residual layer: FSDP2's unit here."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


def make_model(width: int = 16) -> nn.Module:
    """The same weights in every call (a fixed seed), on the CPU."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), Block(width), Block(width), nn.Linear(width, 1))


def data(device: torch.device, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1 + step)
    x, y = torch.randn(ROWS, 4, generator=generator), torch.randn(ROWS, 1, generator=generator)
    return x.to(device), y.to(device)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def state_cpu(model: nn.Module) -> dict[str, torch.Tensor]:
    """The bare model's whole state on the CPU (no DDP/compile prefix; FSDP2's DTensors
    gathered)."""
    out = {}
    for key, value in unwrap(model).state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[key] = full.detach().cpu().clone()
    return out


def bf16_autocast(device: torch.device) -> list[bool]:
    """bf16 differs from float32 (autocast ran) but stays within a bf16 tolerance of it."""
    x, y = data(device)
    reference = loss_of(ddpkit.wrap(make_model()), x, y)
    model = ddpkit.wrap(make_model(), precision="bf16")
    out = model(x)
    loss = loss_of(model, x, y)
    loss.backward()
    grads = all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    close = torch.allclose(loss, reference, rtol=5e-2, atol=1e-3)
    differs = not torch.equal(loss, reference)
    return [
        check(
            "bf16 autocast: float32 outputs and grads, loss near float32's, not equal",
            out.dtype == torch.float32 and grads and close and differs,
            f"loss {loss.item():.6f} vs float32 {reference.item():.6f}, out {out.dtype}",
        )
    ]


def _fp16_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    scaler = ddpkit.grad_scaler(model)
    device = next(model.parameters()).device
    for step in steps:
        x, y = data(device, step)
        loss = loss_of(model, x, y)
        if step == 1:  # fp16 gradients overflow: the scaler skips this step, halves its scale
            loss = loss * 1e8
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


def fp16_resume(device: torch.device, folder: Path) -> list[bool]:
    """6 fp16 steps uninterrupted vs 3, a checkpoint, a fresh model loading it, 3 more:
    the same weights bitwise and the same (once halved) loss scale."""
    model = ddpkit.wrap(make_model(), precision="fp16")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _fp16_steps(model, optimizer, range(6))
    want, want_scale = state_cpu(model), ddpkit.grad_scaler(model).get_scale()

    model = ddpkit.wrap(make_model(), precision="fp16")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _fp16_steps(model, optimizer, range(3))
    saved_scale = ddpkit.grad_scaler(model).get_scale()
    ddpkit.save_checkpoint(folder, {"model": model, "optimizer": optimizer}, step=3)
    fresh = ddpkit.wrap(make_model(), precision="fp16")
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    before = ddpkit.grad_scaler(fresh).get_scale()
    step = ddpkit.load_checkpoint(folder, {"model": fresh, "optimizer": fresh_optimizer})
    loaded = ddpkit.grad_scaler(fresh).get_scale()
    _fp16_steps(fresh, fresh_optimizer, range(3, 6))
    got, got_scale = state_cpu(fresh), ddpkit.grad_scaler(fresh).get_scale()
    same = all(torch.equal(want[k], got[k]) for k in want)
    scale_ok = saved_scale < before and loaded == saved_scale and got_scale == want_scale
    return [
        check(
            "fp16 + GradScaler: the scale travels through the checkpoint",
            step == 3 and scale_ok,
            f"saved {saved_scale}, fresh {before}, loaded {loaded}, end {got_scale} vs "
            f"{want_scale}",
        ),
        check("fp16 resume: weights bitwise those of the uninterrupted run", same),
    ]


def compile_vs_eager(device: torch.device, backend: str | None) -> list[bool]:
    """5 SGD steps: compiled (auto, and DDP at world 1) losses allclose to eager's."""
    options: bool | dict[str, Any] = {"backend": backend} if backend else True

    def losses(strategy: str, compile: bool | dict[str, Any]) -> list[float]:
        model = ddpkit.wrap(make_model(), strategy, compile=compile)
        return _plain_steps(model, torch.optim.SGD(model.parameters(), lr=0.05), range(5))

    from torch._dynamo.utils import counters

    eager = losses("auto", False)
    results = []
    for strategy in ("auto", "ddp"):
        name = f"wrap(strategy={strategy!r}, compile=True): losses allclose to eager"
        try:
            torch._dynamo.reset()  # else the graph of the run before is reused: none made
            graphs = counters["stats"]["unique_graphs"]
            got = losses(strategy, options)
            compiled = counters["stats"]["unique_graphs"] > graphs
            close = torch.allclose(torch.tensor(got), torch.tensor(eager), rtol=1e-4, atol=1e-6)
            results.append(
                check(
                    name,
                    close and compiled,
                    f"graphs compiled {compiled}, {got[-1]:.6f} vs {eager[-1]:.6f}",
                )
            )
        except Exception as error:  # report, do not hide
            results.append(check(name, False, repr(error)[:300]))
    return results


def _plain_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    device = next(model.parameters()).device
    out = []
    for step in steps:
        loss = loss_of(model, *data(device, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def fsdp_checkpoint(device: torch.device, folder: Path) -> list[bool]:
    """FSDP2 at world 1: 3 steps on the plain model's trajectory, a sharded checkpoint, 3 more;
    a fresh CPU process loads it into a plain model: its state allclose to the saved one, and
    its 3 steps allclose to the FSDP2 model's."""
    plain = make_model().to(device)
    want = _plain_steps(plain, torch.optim.Adam(plain.parameters(), lr=0.01), range(3))
    model = ddpkit.wrap(make_model(), "fsdp", fsdp_blocks=(Block,))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    got = _plain_steps(model, optimizer, range(3))
    close = torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)
    results = [
        check(
            "FSDP2 at world 1: losses allclose to the plain model's",
            close,
            f"{type(model).__name__}, {got[-1]:.6f} vs {want[-1]:.6f}",
        )
    ]
    ddpkit.save_checkpoint(folder, {"model": model, "optimizer": optimizer}, step=3)
    reference = folder / "saved-state.pt"
    torch.save(
        {"state": state_cpu(model), "after": _plain_steps(model, optimizer, range(3, 6))}, reference
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, __file__, "--load-on-cpu", str(folder)]
    done = subprocess.run(
        command, check=False, env=env, capture_output=True, text=True, timeout=120
    )
    print(done.stdout + done.stderr[-2000:], end="", flush=True)
    results.append(
        check(
            "FSDP2 checkpoint saved here, loaded on CPU (another process)",
            done.returncode == 0,
            f"rc {done.returncode}",
        )
    )
    return results


def load_on_cpu(folder: Path) -> int:
    """The CPU half of :func:`fsdp_checkpoint`: no process group, a plain model."""
    reference = torch.load(folder / "saved-state.pt", weights_only=True)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    step = ddpkit.load_checkpoint(
        folder, {"model": model, "optimizer": optimizer}, map_location="cpu"
    )
    got = model.state_dict()
    want = reference["state"]
    close = set(got) == set(want) and all(torch.allclose(got[k], want[k]) for k in want)
    after = _plain_steps(model, optimizer, range(3, 6))
    same_path = torch.allclose(
        torch.tensor(after), torch.tensor(reference["after"]), rtol=1e-4, atol=1e-6
    )
    results = [
        check(
            "  loaded on CPU: state allclose to the saved one",
            step == 3 and close,
            f"step {step}, {len(got)} tensors, on {sorted({str(v.device) for v in got.values()})}",
        ),
        check(
            "  loaded on CPU: its next 3 losses allclose to the sharded model's",
            same_path,
            f"{after[-1]:.6f} vs {reference['after'][-1]:.6f}",
        ),
    ]
    return 0 if all(results) else 1


def accumulation(device: torch.device) -> list[bool]:
    """2 windows of 3 micro-batches of 4 rows (mean loss each, not divided by 3) give the
    weights of 2 steps on the 12 rows, under each strategy."""
    plain = make_model().to(device)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    _plain_steps(plain, optimizer, range(2))
    want = state_cpu(plain)
    results = []
    for strategy, options in (("auto", {}), ("ddp", {}), ("fsdp", {"fsdp_blocks": (Block,)})):
        name = f"accumulate(every=3) under {strategy!r}: weights allclose to whole batches"
        try:
            model = ddpkit.wrap(make_model(), strategy, **options)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            steps = 0
            for step in range(2):
                x, y = data(device, step)
                for part in range(3):
                    rows = slice(4 * part, 4 * part + 4)
                    with ddpkit.accumulate(model, every=3) as micro:
                        loss_of(model, x[rows], y[rows]).backward()
                    if micro.sync:
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        steps += 1
            got = state_cpu(model)
            close = all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6) for k in want)
            results.append(check(name, close and steps == 2, f"{steps} optimizer steps"))
        except Exception as error:
            results.append(check(name, False, repr(error)[:300]))
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--cpu-dry", action="store_true", help="CPU and gloo, where no GPU is")
    parser.add_argument("--load-on-cpu", type=Path, help="(internal) the FSDP2 check's CPU half")
    args = parser.parse_args()
    if args.load_on_cpu is not None:
        return load_on_cpu(args.load_on_cpu)
    if args.dir is None:
        parser.error("--dir is required")
    ctx = ddpkit.init(device="cpu" if args.cpu_dry else None)
    want = ("cpu", "gloo") if args.cpu_dry else ("cuda", "nccl")
    results = [
        check(
            "init",
            (ctx.device.type, ctx.backend) == want and ctx.world_size == 1,
            f"device {ctx.device}, backend {ctx.backend}, world {ctx.world_size}",
        )
    ]
    if not results[0]:
        ddpkit.shutdown()
        return 1
    checks = [
        ("bf16", lambda: bf16_autocast(ctx.device)),
        ("fp16", lambda: fp16_resume(ctx.device, args.dir / "fp16")),
        ("compile", lambda: compile_vs_eager(ctx.device, "aot_eager" if args.cpu_dry else None)),
        ("fsdp", lambda: fsdp_checkpoint(ctx.device, args.dir / "fsdp")),
        ("accumulate", lambda: accumulation(ctx.device)),
    ]
    for name, run in checks:
        try:
            results += run()
        except Exception as error:  # one broken feature must not hide the others' results
            results.append(check(name, False, repr(error)[:400]))
    ddpkit.shutdown()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
