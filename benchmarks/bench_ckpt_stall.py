"""Training stall per checkpoint: ddpkit.async_save_checkpoint vs the savers a loop waits for.

Run as one process (no launcher needed)::

    python benchmarks/bench_ckpt_stall.py [--params-mb 128] [--runs 6] [--steps 100]
                                          [--every 50] [--loops 2] [--dir DIR] [--quick]
                                          [--json F]

The state is a model of ``--params-mb`` MB of float32 parameters and its Adam optimizer after
one step (about three times that in all). The stall is how long the training loop is blocked
by one checkpoint: the whole call for a synchronous saver (``torch.save`` of the state dicts,
``torch.distributed.checkpoint.save``, Lightning Fabric's ``fabric.save``, Accelerate's
``accelerator.save_state``, and, as an extra, ``ddpkit.save_checkpoint``), the time until the
call returns for the asynchronous ones (``ddpkit.async_save_checkpoint``: the state copied to
host memory, the write in a thread; DCP's ``async_save``: its own staging, the write in a
thread pool). Before the next saver starts, the background write is waited for (not counted:
that is what the loop overlaps with its steps) and the dirty pages of the page cache are
written back (``os.sync``), so that no saver pays for another's write. Each trial runs
every saver once, the order rotating from trial to trial. Printed: seconds per trial, the
medians, for the async savers the whole write too, and the ratios saver / ddpkit async with
the goal (>= 5 for every synchronous saver) and whether it is met.

Second figure: the throughput of a training loop (``--steps`` Adam steps on batches of 64) that
checkpoints every ``--every`` steps with ddpkit async, against the same loop that never does
and one that calls ``torch.save`` instead, ``--loops`` trials in rotating order; the time runs
until the last step (the last write finishes after it, outside the figure). Goal: ddpkit async
at >= 0.95 of the loop that never checkpoints (shown as a reference: the ceiling). Real jobs
checkpoint every few minutes; ``--every`` sets how much training a write overlaps with: when
the steps between two checkpoints take less time than one write, the next async save waits for
the previous write (at most one in flight), and the figure measures the disk, not the overlap
(each loop trial prints the time spent inside the saver's calls).

``--device cuda``: the model and its optimizer state live on the GPU, so every saver pays the
copy to host memory as well (ddpkit async returns once its host copy is taken); the clock
starts and the loop's figure ends after ``torch.cuda.synchronize``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchjson
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import ddpkit

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*existing checkpoint.*")
warnings.filterwarnings("ignore", category=FutureWarning)

WIDTH = 2048  # Linear(2048, 2048) layers: 16 MB of float32 weights each
STALL_GOAL = 5.0
LOOP_GOAL = 0.95
ASYNC = "ddpkit.async_save_checkpoint"
SYNC_SAVERS = ["torch.save", "dcp.save", "fabric.save", "accelerate save_state"]
EXTRA = ["ddpkit.save_checkpoint"]  # printed, not a row of the figure: ddpkit's own sync save
LOOPS = ["never", "ddpkit async", "torch.save"]
DEVICE = torch.device("cpu")  # set by main() from --device


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def make_state(params_mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = max(1, round(params_mb * 2**20 / (4 * (WIDTH * WIDTH + WIDTH))))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers))).to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for parameter in model.parameters():  # one step fills Adam's state without a forward pass
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    return model, optimizer


# A saver returns what waits for its background write (None: it wrote before returning).
Saver = Callable[[int], Callable[[], object] | None]


def savers(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Saver]:
    found: dict[str, Saver] = {}

    def ours(step: int) -> Callable[[], object]:
        state = {"model": model, "optim": optimizer, "step": step}
        return ddpkit.async_save_checkpoint(root / "ddpkit", state, step=step, keep_last=1).wait

    def ours_sync(step: int) -> None:
        state = {"model": model, "optim": optimizer, "step": step}
        ddpkit.save_checkpoint(root / "ddpkit-sync", state, step=step, keep_last=1)

    def plain(step: int) -> None:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, root / "p.pt")

    def dcp_state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    def dcp_sync(step: int) -> None:
        dcp.save(dcp_state(), checkpoint_id=root / "dcp")

    def dcp_async(step: int) -> Callable[[], object]:
        return dcp.async_save(dcp_state(), checkpoint_id=root / "dcp-async").result

    found.update({ASYNC: ours, "torch.save": plain, "dcp.save": dcp_sync})
    found["dcp.async_save"] = dcp_async
    try:
        import lightning_fabric
    except ImportError:
        try:  # the ``lightning`` package ships it as lightning.fabric
            import lightning.fabric as lightning_fabric
        except ImportError:
            lightning_fabric = None  # type: ignore[assignment]
    if lightning_fabric is not None:
        fabric = lightning_fabric.Fabric(accelerator=DEVICE.type, devices=1)

        def fabric_save(step: int) -> None:
            fabric.save(
                root / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": step}
            )

        found["fabric.save"] = fabric_save
    try:
        from accelerate import Accelerator
    except ImportError:
        pass
    else:
        accelerator = Accelerator(cpu=DEVICE.type == "cpu")
        accelerator.prepare(model, optimizer)  # in one process: the same objects

        def accelerate_save(step: int) -> None:
            accelerator.save_state(root / "accelerate")

        found["accelerate save_state"] = accelerate_save
    found["ddpkit.save_checkpoint"] = ours_sync
    return found


def stall_trial(actions: dict[str, Saver], order: list[str], step: int) -> dict[str, float]:
    times: dict[str, float] = {}
    for name in order:
        os.sync()  # the previous saver's dirty pages written back first, not during this one
        sync()
        start = time.perf_counter()
        finish = actions[name](step)
        times[name] = time.perf_counter() - start
        if finish is not None:  # the whole write, for the record; the next saver starts after
            finish()
            times[f"{name} (whole write)"] = time.perf_counter() - start
    return times


def loop_trial(
    kind: str, root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
    *, steps: int, every: int,
) -> float:  # fmt: skip
    """Steps per second of ``steps`` training steps, checkpointing every ``every`` (``kind``)."""
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(64, WIDTH, generator=generator).to(DEVICE) for _ in range(4)]
    sync()
    blocked = 0.0  # inside the saver's call: for ddpkit async, the copy and any wait for the
    start = time.perf_counter()  # previous write (a checkpoint interval shorter than a write)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        model(batches[step % 4]).square().mean().backward()
        optimizer.step()
        if step % every or step == steps:
            continue
        called = time.perf_counter()
        if kind == "ddpkit async":
            state = {"model": model, "optim": optimizer, "step": step}
            ddpkit.async_save_checkpoint(root / "loop", state, step=step, keep_last=1)
        elif kind == "torch.save":
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            torch.save(state, root / "loop.pt")
        blocked += time.perf_counter() - called
    sync()
    elapsed = time.perf_counter() - start
    ddpkit.wait_for_checkpoint()
    if kind != "never":
        print(f"loop {kind}: {elapsed:.2f} s, of which {blocked:.3f} s inside the saver's calls")
    return steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-mb", type=int, default=128)
    parser.add_argument("--runs", type=int, default=6, help="stall trials after one warm-up")
    parser.add_argument("--steps", type=int, default=100, help="training steps per loop trial")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    parser.add_argument(
        "--loops", type=int, default=2, help="loop trials per variant (0: no loop figure)"
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.params_mb, args.runs = min(args.params_mb, 8), min(args.runs, 2)
        args.steps, args.every, args.loops = min(args.steps, 12), min(args.every, 6), 1
    global DEVICE  # noqa: PLW0603  (the script's one setting, read by its helpers)
    DEVICE = torch.device(args.device)
    load = os.getloadavg()[0]
    model, optimizer = make_state(args.params_mb)
    root = Path(tempfile.mkdtemp(prefix="bench-stall-", dir=args.dir))
    try:
        actions = savers(root, model, optimizer)
        names = list(actions)
        trials = [
            stall_trial(actions, rotate(names, number), number) for number in range(args.runs + 1)
        ][1:]  # the first trial warms up allocators, the page cache and each library
        size_mb = (root / "p.pt").stat().st_size / 2**20
        loops: dict[str, list[float]] = {kind: [] for kind in LOOPS}
        for number in range(args.loops):
            for kind in rotate(LOOPS, number):
                loops[kind].append(
                    loop_trial(kind, root, model, optimizer, steps=args.steps, every=args.every)
                )
        where = root.parent
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average (1 min) at start / end: {load:.2f} / {os.getloadavg()[0]:.2f}")
    missing = [name for name in SYNC_SAVERS if name not in names]
    stall = report_stall(trials, names, size_mb, where, missing)
    rate = report_loops(loops, args) if args.loops else {}
    where_state = f", on {torch.cuda.get_device_name(DEVICE)}" if DEVICE.type == "cuda" else ""
    figure = f"stall per checkpoint ({size_mb:.0f} MB: model + Adam{where_state})"
    rows = [
        benchjson.row(figure, name, stall[name], "s", False, trials=[t[name] for t in trials])
        for name in names
        if name not in EXTRA
    ]
    loop_figure = f"training loop, checkpoint every {args.every} steps{where_state}"
    labels = {"never": "no checkpoint", "ddpkit async": ASYNC, "torch.save": "torch.save"}
    # the loop that never checkpoints is the ceiling, not a baseline to beat
    rows += [
        benchjson.row(loop_figure, labels[kind], rate[kind], "steps/s", True,
                      trials=loops[kind], reference=kind == "never")
        for kind in LOOPS if rate
    ]  # fmt: skip
    notes = [f"{name}: not installed" for name in missing]
    if rate:  # the goal is against the ceiling, which the table shows as a reference only
        ratio = rate["ddpkit async"] / rate["never"]
        verdict = "met" if ratio >= LOOP_GOAL else "NOT met"
        notes.append(f"loop goal, ddpkit async >= {LOOP_GOAL} of the loop that never "
                     f"checkpoints: {ratio:.3f}, {verdict}")  # fmt: skip
    title = "Checkpoint stall: ddpkit async vs torch.save, DCP, Lightning Fabric, Accelerate"
    benchjson.write(args.json, "ckpt_stall", title, "python", rows, notes=notes)


def rotate(names: list[str], number: int) -> list[str]:
    shift = number % len(names)
    return names[shift:] + names[:shift]


def report_stall(
    trials: list[dict[str, float]], names: list[str], size_mb: float, where: Path,
    missing: list[str],
) -> dict[str, float]:  # fmt: skip
    print(
        f"state: {size_mb:.0f} MB (torch.save's file) under {where}, {len(trials)} trials after "
        f"one warm-up, order rotating; not installed: {', '.join(missing) or 'none'}"
    )
    median: dict[str, float] = {}
    shown_names = [*names, *(f"{n} (whole write)" for n in (ASYNC, "dcp.async_save"))]
    for name in shown_names:
        values = [t[name] for t in trials if name in t]
        if not values:
            continue
        median[name] = statistics.median(values)
        label = f"extra: {name}" if name in EXTRA or "whole" in name else name
        shown = " ".join(f"{value:6.3f}" for value in values)
        print(f"stall {label:46s} s: {shown}   median {median[name]:6.3f} s")
    for name in [n for n in names if n != ASYNC]:
        ratio = median[name] / median[ASYNC]
        goal = name in SYNC_SAVERS
        verdict = f"goal >= {STALL_GOAL:g}: {'met' if ratio >= STALL_GOAL else 'NOT met'}"
        print(f"ratio stall {name} / ddpkit async {ratio:8.1f}  {verdict if goal else ''}".rstrip())
    return median


def report_loops(loops: dict[str, list[float]], args: argparse.Namespace) -> dict[str, float]:
    print(
        f"loop: {args.steps} steps of batch 64, a checkpoint every {args.every} steps, "
        f"{args.loops} trials per variant in rotating order"
    )
    rate = {kind: statistics.median(values) for kind, values in loops.items()}
    for kind, values in loops.items():
        shown = " ".join(f"{value:6.2f}" for value in values)
        print(f"loop {kind:14s} steps/s: {shown}   median {rate[kind]:6.2f}")
    for kind in ("ddpkit async", "torch.save"):
        ratio = rate[kind] / rate["never"]
        verdict = f"goal >= {LOOP_GOAL}: {'met' if ratio >= LOOP_GOAL else 'NOT met'}"
        print(f"ratio loop {kind} / never {ratio:.3f}  {verdict if kind != 'torch.save' else ''}")
    return rate


if __name__ == "__main__":
    main()
