"""Checkpoint throughput: ddpkit.save_checkpoint / load_checkpoint vs torch.save / load and DCP.

Run as one process (no launcher needed)::

    python benchmarks/bench_checkpoint.py [--params-mb 128] [--runs 6] [--dir DIR]
                                          [--without writeback,drop-cache] [--quick] [--json F]

The state is a model of ``--params-mb`` MB of float32 parameters and its Adam optimizer after
one step (exp_avg and exp_avg_sq: about three times that in all), plus a step counter. Each
trial saves the same state both ways, then loads it both ways, the side that goes first
rotating from trial to trial (keep ``--runs`` a multiple of 3 so that each order counts as
often), so that machine and page-cache noise hits all alike. Printed: MB/s per trial, the
medians in MB/s and seconds, and the ratios ddpkit / plain and ddpkit / DCP with the goal
(>= 0.9) and whether it is met.

The headline baseline is what a script without ddpkit does: ``torch.save(state, path)`` to the
same path every time (no fsync: the data sits in the page cache until the kernel writes it
back), and to resume, ``torch.load(path, weights_only=False)`` followed by the model's and the
optimizer's ``load_state_dict`` (a resume that only deserializes has not resumed). ddpkit
writes a temporary file, fsyncs it, renames it, fsyncs the directory and deletes the previous
checkpoint (``keep_last=1``); its load checks the file's header and restores the model, the
optimizer and the RNG states in place. The third side is ``torch.distributed.checkpoint`` (DCP,
one process: ``dcp.save`` of ``get_state_dict(model, optimizer)`` to the same directory each
time; ``dcp.load`` into the live tensors, then ``set_state_dict``). Extra lines, not part of
the headline ratios: torch.save followed by an fsync (what durability costs the baseline),
torch.save to a new file each time (no truncated previous file whose page-cache pages it can
reuse, as a crash-safe writer cannot have), and torch.load alone (deserializing only: a floor,
shown as a reference, not a competitor). ``--without`` turns ddpkit's write-path measures
off, to see what each is worth: ``writeback`` (the sync_file_range hints during the write),
``drop-cache`` (releasing the pages of the checkpoints the save will delete before writing).
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ddpkit
from ddpkit.worker import checkpoint, durable

# DCP in one process warns that there is no process group, and when it overwrites its directory
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*existing checkpoint.*")

WIDTH = 2048  # one Linear(2048, 2048) layer: 16 MB of float32 weights + 8 KB of bias
GOAL = 0.9
SIDES = ["plain", "ddpkit", "dcp"]
HEADLINE = [f"{side}_{what}" for what in ("save", "load") for side in SIDES]
EXTRAS = ["plain_save_fsync", "plain_save_new", "plain_load_only"]
LABELS = {
    "plain_save": "torch.save, same path",
    "ddpkit_save": "ddpkit.save_checkpoint",
    "plain_load": "torch.load + load_state_dict",
    "ddpkit_load": "ddpkit.load_checkpoint",
    "dcp_save": "torch.distributed.checkpoint.save",
    "dcp_load": "torch.distributed.checkpoint.load",
    "plain_save_fsync": "extra: torch.save + fsync",
    "plain_save_new": "extra: torch.save, new file",
    "plain_load_only": "extra: torch.load alone, deserialize only",
}


def make_state(params_mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = max(1, round(params_mb * 2**20 / (4 * (WIDTH * WIDTH + WIDTH))))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for parameter in model.parameters():  # one step fills Adam's state without a forward pass
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    return model, optimizer


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def plain_save(path: Path, state: dict[str, Any], fsync: bool) -> None:
    torch.save(state, path)
    if fsync:
        with open(path, "rb+") as written:
            os.fsync(written.fileno())


def plain_save_new(root: Path, number: int, state: dict[str, Any]) -> None:
    """torch.save to a file that did not exist; the previous one is deleted afterwards."""
    torch.save(state, root / f"new-{number}.pt")
    (root / f"new-{number - 1}.pt").unlink(missing_ok=True)


def dcp_save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def dcp_load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """DCP loads into the live tensors of the state dicts, then they are set back (in place)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def restore(loaded: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What a by-hand resume does after torch.load: the same in-place restore as ddpkit's."""
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optim"])


def trial(
    root: Path, number: int, model: nn.Module, optimizer: torch.optim.Optimizer, sides: list[str]
) -> dict[str, float]:
    plain_path = root / "plain.pt"
    ours_dir = root / "ddpkit"
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": number}
    actions: dict[str, Callable[[], object]] = {
        "plain_save": lambda: plain_save(plain_path, state, fsync=False),
        "ddpkit_save": lambda: ddpkit.save_checkpoint(
            ours_dir, {"model": model, "optim": optimizer, "step": number}, step=number, keep_last=1
        ),
        "plain_load": lambda: restore(torch.load(plain_path, weights_only=False), model, optimizer),
        "ddpkit_load": lambda: ddpkit.load_checkpoint(
            ours_dir, {"model": model, "optim": optimizer, "step": 0}
        ),
        "dcp_save": lambda: dcp_save(root / "dcp", model, optimizer),
        "dcp_load": lambda: dcp_load(root / "dcp", model, optimizer),
        "plain_save_fsync": lambda: plain_save(plain_path, state, fsync=True),
        "plain_save_new": lambda: plain_save_new(root, number, state),
        "plain_load_only": lambda: torch.load(plain_path, weights_only=False),
    }
    order = [f"{side}_{what}" for what in ("save", "load") for side in sides]
    times = {name: timed(actions[name]) for name in order}
    # The extras last, in a fixed order: the headline figures do not depend on them.
    times.update({name: timed(actions[name]) for name in EXTRAS})
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-mb", type=int, default=128)
    parser.add_argument(
        "--runs", type=int, default=6, help="trials after one warm-up (a multiple of 3)"
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--without",
        default="",
        help="comma-separated ddpkit write measures to turn off: writeback, drop-cache",
    )
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.params_mb, args.runs = min(args.params_mb, 8), min(args.runs, 3)
    disabled = {name for name in args.without.split(",") if name}
    unknown = disabled - {"writeback", "drop-cache"}
    if unknown:
        parser.error(f"--without: unknown {sorted(unknown)} (known: writeback, drop-cache)")
    if "writeback" in disabled:
        durable._sync_file_range = lambda: None  # the streaming file asks for it per file
    if "drop-cache" in disabled:
        checkpoint.drop_cache = lambda paths: None  # the name save_payload calls
    model, optimizer = make_state(args.params_mb)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        trials = [
            trial(root, number, model, optimizer, rotate(number)) for number in range(args.runs + 1)
        ][1:]  # the first trial warms up allocators and the page cache
        size_mb = (root / "plain.pt").stat().st_size / 2**20
        where = root.parent
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = report(trials, size_mb, where, sorted(disabled))
    rows = [
        benchjson.row(f"checkpoint {what} ({size_mb:.0f} MB: model + Adam)", LABELS[name],
                      median[name], "MB/s", True, trials=[size_mb / t[name] for t in trials])
        for what in ("save", "load")
        for name in [*HEADLINE, "plain_save_fsync", "plain_load_only"] if f"_{what}" in name
    ]  # fmt: skip
    notes = [f"ddpkit write measures off: {', '.join(sorted(disabled))}"] if disabled else []
    title = "Checkpoints: ddpkit vs torch.save / torch.load and torch.distributed.checkpoint"
    benchjson.write(args.json, "checkpoint", title, "python", rows, notes=notes)


def rotate(number: int) -> list[str]:
    shift = number % len(SIDES)
    return SIDES[shift:] + SIDES[:shift]


def report(
    trials: list[dict[str, float]], size_mb: float, where: Path, off: list[str]
) -> dict[str, float]:
    firsts = [rotate(number)[0] for number in range(1, len(trials) + 1)]
    print(
        f"state: {size_mb:.0f} MB on disk under {where}, {len(trials)} trials after one warm-up "
        f"(first side per trial: {' '.join(firsts)}); ddpkit measures off: {off or 'none'}"
    )
    median: dict[str, float] = {}
    for name in HEADLINE + EXTRAS:
        rates = [size_mb / t[name] for t in trials]
        median[name] = statistics.median(rates)
        seconds = statistics.median(t[name] for t in trials)
        shown = " ".join(f"{rate:5.0f}" for rate in rates)
        print(
            f"{LABELS[name]:36s} MB/s: {shown}   median {median[name]:5.0f} MB/s, {seconds:.3f} s"
        )
    for label, ours, theirs, headline in [
        ("save: ddpkit / torch.save", "ddpkit_save", "plain_save", True),
        ("load: ddpkit / torch.load + restore", "ddpkit_load", "plain_load", True),
        ("save: ddpkit / DCP", "ddpkit_save", "dcp_save", True),
        ("load: ddpkit / DCP", "ddpkit_load", "dcp_load", True),
        ("extra, save: ddpkit / torch.save + fsync", "ddpkit_save", "plain_save_fsync", False),
        ("extra, save: ddpkit / torch.save new file", "ddpkit_save", "plain_save_new", False),
        ("extra, load: ddpkit / torch.load alone", "ddpkit_load", "plain_load_only", False),
    ]:
        ratio = median[ours] / median[theirs]
        verdict = f"goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'}" if headline else ""
        print(f"ratio {label:44s} {ratio:.2f}  {verdict}".rstrip())
    return median


if __name__ == "__main__":
    main()
