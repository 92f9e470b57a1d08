"""yolov5's torch_distributed_zero_first around the dataset cache (ddpkit_idiomlib.yolov5_utils;
source: ultralytics/yolov5, utils/torch_utils.py, as train.py uses it around
check_dataset/create_dataloader).
Its exercise() runs in all_idioms.py, the library installed (tests/test_corpus.py)."""

from __future__ import annotations

import os

from corpus_start import scratch
from ddpkit_idiomlib.yolov5_utils import LOCAL_RANK, RANK, WORLD_SIZE, torch_distributed_zero_first


def exercise(rank: int, world_size: int) -> None:
    print(f"yolov5: LOCAL_RANK={LOCAL_RANK} RANK={RANK} WORLD_SIZE={WORLD_SIZE}")
    path = scratch("yolov5-labels.cache")
    for attempt in range(2):  # train.py enters it for the data check and for the loader
        with torch_distributed_zero_first(LOCAL_RANK):
            if not os.path.exists(path):
                with open(path, "w") as out:
                    out.write(f"cache written by rank {rank}")
            with open(path) as cache:
                text = cache.read()
        print(f"yolov5 zero_first #{attempt}: {text}")
