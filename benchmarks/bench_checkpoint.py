"""Checkpoint throughput: ddpkit.save_checkpoint / load_checkpoint vs plain torch.save / load.

Run as one process (no launcher needed)::

    python benchmarks/bench_checkpoint.py [--params-mb 128] [--runs 5] [--dir DIR]

The state is a model of ``--params-mb`` MB of float32 parameters and its Adam optimizer after
one step (exp_avg and exp_avg_sq: about three times that in all), plus a step counter. Each
trial saves and loads the same state both ways, alternating which goes first, so that
machine and page-cache noise hits both alike. Printed: MB/s per trial, the medians, and the
ratios ddpkit / plain (goal: >= 0.9).

What each side does: plain ``torch.save(state, path)`` (no fsync: what most scripts do) and
``torch.load(path, weights_only=False)``; ddpkit writes a temporary file, fsyncs it, renames
it and fsyncs the directory (crash safety costs the fsync), and its load also restores the
model, the optimizer and the RNG states in place. A second save baseline, torch.save followed
by an fsync, shows how much of any gap is the fsync itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ddpkit

WIDTH = 2048  # one Linear(2048, 2048) layer: 16 MB of float32 weights + 8 KB of bias


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


def restore(loaded: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What a by-hand resume does after torch.load: the same in-place restore as ddpkit's."""
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optim"])


def trial(
    root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, first: str
) -> dict[str, float]:
    plain_path = root / "plain.pt"
    ours_dir = root / "ddpkit"
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 1}
    actions: dict[str, Callable[[], object]] = {
        "plain_save": lambda: plain_save(plain_path, state, fsync=False),
        "plain_save_fsync": lambda: plain_save(plain_path, state, fsync=True),
        "ddpkit_save": lambda: ddpkit.save_checkpoint(
            ours_dir, {"model": model, "optim": optimizer, "step": 1}, step=1, keep_last=1
        ),
        "plain_load": lambda: torch.load(plain_path, weights_only=False),
        "plain_load_restore": lambda: restore(
            torch.load(plain_path, weights_only=False), model, optimizer
        ),
        "ddpkit_load": lambda: ddpkit.load_checkpoint(
            ours_dir, {"model": model, "optim": optimizer, "step": 0}
        ),
    }
    order = ["plain_save", "ddpkit_save", "plain_load", "plain_load_restore", "ddpkit_load"]
    if first == "ddpkit":
        order = ["ddpkit_save", "plain_save", "ddpkit_load", "plain_load", "plain_load_restore"]
    times = {name: timed(actions[name]) for name in order}
    # The fsync baseline last: it rewrites plain.pt, which the plain load above has read.
    times["plain_save_fsync"] = timed(actions["plain_save_fsync"])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-mb", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    model, optimizer = make_state(args.params_mb)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        trials = [
            trial(root, model, optimizer, "plain" if i % 2 == 0 else "ddpkit")
            for i in range(args.runs + 1)
        ][1:]  # the first trial warms up allocators and the page cache
        size_mb = (root / "plain.pt").stat().st_size / 2**20
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(trials, size_mb)


def report(trials: list[dict[str, float]], size_mb: float) -> None:
    names = [
        "plain_save",
        "plain_save_fsync",
        "ddpkit_save",
        "plain_load",
        "plain_load_restore",
        "ddpkit_load",
    ]
    rates = {name: [size_mb / t[name] for t in trials] for name in names}
    print(f"state: {size_mb:.0f} MB on disk, {len(trials)} trials (after one warm-up)")
    for name in names:
        shown = " ".join(f"{rate:7.0f}" for rate in rates[name])
        print(f"{name:18s} MB/s: {shown}   median {statistics.median(rates[name]):7.0f}")
    median = {name: statistics.median(values) for name, values in rates.items()}
    for label, ours, theirs in [
        ("save: ddpkit / torch.save", "ddpkit_save", "plain_save"),
        ("save: ddpkit / torch.save + fsync", "ddpkit_save", "plain_save_fsync"),
        ("load: ddpkit / torch.load", "ddpkit_load", "plain_load"),
        ("load: ddpkit / torch.load + load_state_dict", "ddpkit_load", "plain_load_restore"),
    ]:
        print(f"ratio {label:45s} {median[ours] / median[theirs]:.2f}")


if __name__ == "__main__":
    main()
