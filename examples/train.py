"""A small classifier trained with ddpkit: the four calls that make a script distributed.

Runs unchanged as one process (`python examples/train.py`), under
`ddpkit run --nproc-per-node 2 examples/train.py`, under plain `torchrun`, or inside a SLURM step
(`srun python examples/train.py`).

The data is synthetic (Gaussian clusters, generated from a fixed seed), so nothing is downloaded.
The test set deliberately has a size that does not divide by world size x batch size: the
evaluation still counts every sample exactly once, which the last lines print.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def make_data(n: int, *, classes: int, dim: int, seed: int) -> TensorDataset:
    """Gaussian clusters around fixed random centres: the same data on every rank."""
    gen = torch.Generator().manual_seed(1234)  # centres shared by train and test
    centres = torch.randn(classes, dim, generator=gen) * 2.0
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=gen)
    features = centres[labels] + torch.randn(n, dim, generator=gen) * 4.0
    return TensorDataset(features, labels)


def make_model(dim: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dim, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, classes)
    )


def evaluate(
    model: nn.Module, test: torch.utils.data.DataLoader, device: torch.device
) -> tuple[int, int]:
    """Exact-once evaluation: gather per-sample results, padding duplicates removed."""
    model.eval()
    seen = correct = 0
    with torch.no_grad():
        for features, labels in test:
            features, labels = features.to(device), labels.to(device)
            hits = (model(features).argmax(dim=1) == labels).long()
            everyone = ddpkit.gather(hits)  # all ranks' rows for this step, each sample once
            seen += everyone.numel()
            correct += int(everyone.sum())
    model.train()
    return seen, correct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--train-size", type=int, default=8000)
    parser.add_argument("--test-size", type=int, default=2001)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ctx = ddpkit.init()
    ddpkit.print(
        f"ddpkit: {ctx.info.launcher}, world size {ctx.world_size}, "
        f"backend {ctx.backend}, device {ctx.device}"
    )
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)

    classes, dim = 4, 32
    train_set = make_data(args.train_size, classes=classes, dim=dim, seed=1)
    test_set = make_data(args.test_size, classes=classes, dim=dim, seed=2)
    model = ddpkit.wrap(make_model(dim, classes))
    train = ddpkit.loader(train_set, args.batch_size, shuffle=True, seed=args.seed)
    test = ddpkit.loader(test_set, args.batch_size, shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    start = time.perf_counter()
    for epoch in range(args.epochs):
        total = torch.zeros(2)
        for features, labels in train:  # a new pass: the loader advances its epoch by itself
            features, labels = features.to(ctx.device), labels.to(ctx.device)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(features), labels)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(labels), len(labels)])
        if ctx.world_size > 1:
            torch.distributed.all_reduce(total)
        ddpkit.print(f"epoch {epoch}: loss {total[0] / total[1]:.4f}")

    seen, correct = evaluate(model, test, ctx.device)
    ddpkit.print(
        f"eval: {seen} samples (test set has {len(test_set)}), accuracy {correct / seen:.4f}"
    )
    ddpkit.print(f"done in {time.perf_counter() - start:.1f} s")
    if seen != len(test_set):
        raise SystemExit(f"evaluation saw {seen} samples instead of {len(test_set)}")


if __name__ == "__main__":
    main()
