"""Worker for tests/launch/test_resize_launch.py: one piece of a run that resumes at any world size.

``resize_worker.py DIR EPOCHS STOP``: resumes from the newest checkpoint in DIR (loader position,
step) when there is one, steps through ``dataset[i] == i`` for ``EPOCHS`` epochs (23 samples,
batches of 2, shuffled), and after ``STOP`` steps of this piece (0: never) saves a checkpoint and
exits 0, as a preempted job does before its requeue. Every step, every rank appends one JSON line
to ``DIR/log-<world>-<rank>.jsonl`` (a launch at another world size writes other files): the
epoch, the step, its own sample ids and the ids ``ddpkit.gather`` kept (padding removed).

No model and no optimizer: the samples are what the resize test checks, and building DDP or a
``torch.optim`` optimizer imports ``torch._dynamo`` in every rank (seconds of CPU each).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

import ddpkit

SIZE, BATCH, SEED = 23, 2, 3


class Indices(Dataset[int]):
    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> int:
        return index


def main(folder: Path, epochs: int, stop: int) -> None:
    ctx = ddpkit.init(backend="gloo")
    loader = ddpkit.loader(Indices(), BATCH, seed=SEED)
    state: dict[str, Any] = {"loader": loader, "step": 0}
    ddpkit.load_checkpoint(folder, state)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"log-{ctx.world_size}-{ctx.rank}.jsonl"
    taken = 0
    while loader.state_dict()["epoch"] < epochs:
        for batch in loader:
            kept = ddpkit.gather(batch).tolist()
            state["step"] += 1
            taken += 1
            line = {"epoch": loader.epoch, "step": state["step"], "ids": batch.tolist()}
            with log.open("a") as out:
                out.write(json.dumps({**line, "kept": kept}) + "\n")
            if taken == stop:
                ddpkit.save_checkpoint(folder, state, step=state["step"])
                return


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
