"""Writes the checkpoints of ``legacy/``: files as ddpkit saved them before issue 23.

They were made by ``save_checkpoint`` at commit 42ddb9c (format 2: the write order in the
pickle, read back then with ``torch.load(weights_only=False)``), so that the tests can prove
that such files still load, bitwise, now that loads are ``weights_only``. Run it only with that
version of ddpkit (``git worktree add /tmp/old 42ddb9c``, then
``PYTHONPATH=/tmp/old/src python tests/data/checkpoints/generate.py``): today's code writes
today's files. ``expected.json`` holds what a load must give back: the weights, the next draws
of every RNG and the loader's position.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy
import torch

import ddpkit

HERE = Path(__file__).resolve().parent / "legacy"


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    data = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(20, 2))
    train = ddpkit.loader(data, 4, shuffle=True, seed=3)
    iterator = iter(train)
    next(iterator)
    next(iterator)  # mid-epoch: 2 batches of epoch 0 read
    return {"model": model, "optimizer": optimizer, "train": train, "epoch": 0,
            "loss": torch.tensor([1.5, 8.0]), "note": "legacy"}  # fmt: skip


def main() -> None:
    HERE.mkdir(exist_ok=True)
    ddpkit.init(env={})
    state = _state()
    # Written in this order: step 500 first, then step 100 (a run restarted in a used folder):
    # the newest is step 100, which only the write order recorded in the file can tell.
    ddpkit.save_checkpoint(HERE, {**state, "step": 500}, step=500)
    random.seed(1)
    numpy.random.seed(2)
    torch.manual_seed(3)
    ddpkit.save_checkpoint(HERE, {**state, "step": 100}, step=100)
    expected = {
        "step": 100,
        "weights": [p.tolist() for p in state["model"].state_dict().values()],  # type: ignore[attr-defined]
        "draws": [random.random(), numpy.random.rand(2).tolist(), torch.rand(3).tolist()],
        "train": state["train"].state_dict(),  # type: ignore[attr-defined]
    }
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    ddpkit.shutdown()
    print("wrote", sorted(p.name for p in HERE.iterdir()), file=sys.stderr)


if __name__ == "__main__":
    main()
