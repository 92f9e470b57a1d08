"""A tqdm-style progress bar on the main rank only: each update redraws the line in place with a
carriage return (``\\r``) on stderr, the bar's close ends it with a newline; the other ranks'
bars are disabled. A fixed ``bar_format`` (no rates, no times) keeps the text deterministic.

Source: tqdm/tqdm, tqdm/std.py (``status_printer``: ``fp.write('\\r' + s + padding)``,
``close``: a final newline), used as ``tqdm(loader, disable=not is_main)`` in distributed
training loops (transformers' Trainer: ``disable=not self.is_local_process_zero()``).
Its exercise() runs in all_idioms.py (tests/test_corpus.py)."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist


class Bar:
    """The part of tqdm this idiom needs: redraw in place, newline at close."""

    def __init__(self, total: int, desc: str, disable: bool) -> None:
        self.total, self.desc, self.disable = total, desc, disable
        self.n, self.last_len = 0, 0
        self._draw()

    def _draw(self) -> None:
        if self.disable:
            return
        percent, bar = 100 * self.n // self.total, "#" * (10 * self.n // self.total)
        text = f"{self.desc}: {percent:3d}%|{bar:<10}| {self.n}/{self.total}"
        sys.stderr.write("\r" + text + " " * max(self.last_len - len(text), 0))
        sys.stderr.flush()
        self.last_len = len(text)

    def update(self, n: int = 1) -> None:
        self.n += n
        self._draw()

    def close(self) -> None:
        if not self.disable:
            sys.stderr.write("\n")
            sys.stderr.flush()


def exercise(rank: int, world_size: int) -> None:
    bar = Bar(total=4, desc="train", disable=rank != 0)
    total = torch.zeros(1)
    for step in range(4):
        value = torch.tensor([float(step + rank)])
        dist.all_reduce(value)
        total += value
        time.sleep(0.05)  # let the launcher see the line half drawn
        bar.update()
    bar.close()
    print(f"rank {rank}: total {total.item()}")
