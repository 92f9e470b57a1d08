"""Every library idiom in one job, in each layout of the library (tests/test_corpus.py): the
group comes from corpus_start, then each script's exercise() in turn; torchvision's last, as its
setup_for_distributed silences print on the non-master ranks for the rest of the process. The
only run of accelerate's, transformers' and yolov5's exercises (their scripts join through
corpus_start too); torchvision's and timm's scripts also run on their own, joining through the
library's init helper."""

from __future__ import annotations

import lib_accelerate
import lib_timm
import lib_torchvision
import lib_transformers
import lib_yolov5
from corpus_start import finish, start
from ddpkit_idiomlib import torchvision_utils

if __name__ == "__main__":
    rank, world_size = start()
    for idiom in (lib_accelerate, lib_transformers, lib_yolov5, lib_timm):
        idiom.exercise(rank, world_size)
    torchvision_utils.setup_for_distributed(rank == 0)
    lib_torchvision.exercise(rank, world_size)
    finish()
