"""The trivial worker bench_launch.py starts: join a gloo group, one all_reduce, exit."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
if dist.get_rank() == 0:
    print(f"world {dist.get_world_size()}: sum {value.item():.0f}")
dist.destroy_process_group()
