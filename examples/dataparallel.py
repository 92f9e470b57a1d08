"""DataParallel done right, runnable: stock DP, balanced DP, a model split across devices.

    python examples/dataparallel.py            # any machine: GPUs are used where they exist

1. Stock DataParallel: ``model(x)`` gathers every replica's output on the output device and the
   loss runs there, so that device's memory peaks far above the others'.
2. Balanced: ``ddpkit.balanced_loss`` computes the loss beside each slice; only scalars reach the
   output device, weighted by slice size, so the loss equals the whole batch's loss.
3. A model split across devices (the tutorial's embedding on the CPU, the rest on a GPU), written
   so that it runs on current torch, kept in place by ``ddpkit.wrap``.

On a machine without GPUs, ``strategy="dp"`` runs as ``single`` (one warning), and the balanced
step is shown on four CPU "devices" (threads sharing the model): the same code path, no memory
figures. With GPUs, each part prints every GPU's peak memory.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

import ddpkit


class SplitModel(nn.Module):
    """The tutorial's model, fixed: its ``super().__init__(embedding=..., rnn=...)`` raises
    TypeError on current torch; submodules are attributes set after ``super().__init__()``."""

    def __init__(self, vocab: int, hidden: int, classes: int, gpu: torch.device) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)  # stays on the CPU: large, rarely hot
        self.rnn = nn.GRU(hidden, hidden, batch_first=True).to(gpu)
        self.head = nn.Linear(hidden, classes).to(gpu)
        self.gpu = gpu

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        features = self.embedding(tokens.cpu()).to(self.gpu)
        out, _ = self.rnn(features)
        logits: torch.Tensor = self.head(out[:, -1])
        return logits


def _peaks() -> str:
    if not torch.cuda.is_available():
        return "no GPU: no memory figures"
    return ", ".join(
        f"cuda:{i} {torch.cuda.max_memory_allocated(i) / 2**20:.1f} MiB"
        for i in range(torch.cuda.device_count())
    )


def _reset_peaks() -> None:
    for index in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--classes", type=int, default=1000)
    args = parser.parse_args()

    ctx = ddpkit.init()
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, args.features)
    y = torch.randint(0, args.classes, (args.batch_size,))
    criterion = nn.CrossEntropyLoss()

    with warnings.catch_warnings(record=True) as caught:  # dp on a CPU: said once, shown here
        warnings.simplefilter("always")
        model = ddpkit.wrap(nn.Linear(args.features, args.classes), "dp")
    for warning in caught:
        print(f"note: {warning.message}")
    device = ctx.device
    x, y = x.to(device), y.to(device)

    _reset_peaks()
    whole = criterion(model(x), y)  # 1. stock: outputs gathered, loss on the output device
    whole.backward()
    print(f"stock: loss {whole.item():.6f} ({type(model).__name__}); peaks: {_peaks()}")

    model.zero_grad()
    _reset_peaks()
    devices = None if torch.cuda.device_count() > 1 else ["cpu"] * 4
    if devices is not None:  # no DataParallel here: show the same path on 4 CPU "devices"
        model, x, y = model.cpu(), x.cpu(), y.cpu()
    step = ddpkit.balanced_loss(model, criterion, devices=devices)
    loss = step(x, y)  # 2. balanced: per-device losses, weighted by slice size
    loss.backward()
    where = "4 CPU devices" if devices else f"{torch.cuda.device_count()} GPUs"
    print(f"balanced: loss {loss.item():.6f} on {where}, whole batch {whole.item():.6f}; ", end="")
    print(f"peaks: {_peaks()}")

    gpu = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    split = SplitModel(100, 16, args.classes, gpu)
    split = ddpkit.wrap(split)  # 3. parts on several devices: kept where they are
    tokens = torch.randint(0, 100, (args.batch_size, 7))
    loss = ddpkit.balanced_loss(split, criterion)(tokens, y.to(gpu))
    loss.backward()
    placed = sorted({str(p.device) for p in split.parameters()})
    print(f"split model: parts on {', '.join(placed)} kept; loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
