"""The worker bench_idle.py starts: join a gloo group, say so, print a line, sleep, exit."""

import os
import time
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
Path(os.environ["IDLE_READY_DIR"], str(dist.get_rank())).touch()
print(f"rank {dist.get_rank()}: computing", flush=True)
time.sleep(float(os.environ["IDLE_SLEEP_S"]))
dist.destroy_process_group()
