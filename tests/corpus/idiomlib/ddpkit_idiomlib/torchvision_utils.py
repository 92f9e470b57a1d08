"""torchvision's reference-script utilities.

Source: pytorch/vision, references/detection/utils.py and references/classification/utils.py
(``SmoothedValue``/``MetricLogger.synchronize_between_processes``, ``reduce_dict``,
``all_gather``, ``setup_for_distributed``, ``save_on_master``, ``init_distributed_mode``).
Shapes that matter: ``setup_for_distributed`` replaces ``builtins.print`` for the rest of the
process by one that prints on the master only (``force=True`` prints anywhere);
``synchronize_between_processes`` calls a barrier and then an all-reduce per meter;
``reduce_dict`` stacks sorted values into one all-reduce; ``save_on_master`` saves under
``if is_main_process():``; ``init_distributed_mode`` calls ``init_process_group`` itself with
``env://`` and ends with a barrier. Upstream pins NCCL and CUDA; here the backend follows the
machine (gloo without CUDA), as the references' CPU users patch it.
"""

from __future__ import annotations

import builtins
import os
from collections import defaultdict, deque
from typing import Any

import torch
import torch.distributed as dist


def is_dist_avail_and_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def get_rank() -> int:
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def save_on_master(*args: Any, **kwargs: Any) -> None:
    if is_main_process():
        torch.save(*args, **kwargs)


def setup_for_distributed(is_master: bool) -> None:
    """From now on ``print`` prints on the master only, unless called with ``force=True``."""
    original = builtins.print

    def print(*args: Any, **kwargs: Any) -> None:  # shadows the builtin: the point
        force = kwargs.pop("force", False)
        if is_master or force:
            original(*args, **kwargs)

    builtins.print = print


def init_distributed_mode(args: Any) -> None:
    """Join the group torchrun described, or note that this is a one-process run."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.gpu = int(os.environ["LOCAL_RANK"])
    else:
        print("Not using distributed mode")
        args.distributed = False
        return
    args.distributed = True
    if torch.cuda.is_available():
        torch.cuda.set_device(args.gpu)
        args.dist_backend = "nccl"
    else:
        args.dist_backend = "gloo"
    print(f"| distributed init (rank {args.rank}): {args.dist_url}", flush=True)
    dist.init_process_group(
        backend=args.dist_backend,
        init_method=args.dist_url,
        world_size=args.world_size,
        rank=args.rank,
    )
    dist.barrier()
    setup_for_distributed(args.rank == 0)


def all_gather(data: Any) -> list[Any]:
    """Any picklable object from every rank."""
    if get_world_size() == 1:
        return [data]
    gathered: list[Any] = [None] * get_world_size()
    dist.all_gather_object(gathered, data)
    return gathered


def reduce_dict(input_dict: dict[str, torch.Tensor], average: bool = True) -> dict[str, Any]:
    """The dict's values summed (or averaged) over the ranks, keys in the same order."""
    world_size = get_world_size()
    if world_size < 2:
        return input_dict
    with torch.no_grad():
        names = sorted(input_dict)  # the same order on every rank
        values = torch.stack([input_dict[name] for name in names], dim=0)
        dist.all_reduce(values)
        if average:
            values /= world_size
        return dict(zip(names, values, strict=True))


class SmoothedValue:
    """A series of values: a window for the median and the average, totals for the global one."""

    def __init__(self, window_size: int = 20, fmt: str | None = None) -> None:
        self.deque: deque[float] = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0
        self.fmt = fmt or "{median:.4f} ({global_avg:.4f})"

    def update(self, value: float, n: int = 1) -> None:
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self) -> None:
        """The totals of every rank (not the window)."""
        if not is_dist_avail_and_initialized():
            return
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        totals = torch.tensor([self.count, self.total], dtype=torch.float64, device=device)
        dist.barrier()
        dist.all_reduce(totals)
        count, total = totals.tolist()
        self.count = int(count)
        self.total = total

    @property
    def median(self) -> float:
        return float(torch.tensor(list(self.deque)).median().item())

    @property
    def global_avg(self) -> float:
        return self.total / self.count

    def __str__(self) -> str:
        return self.fmt.format(median=self.median, global_avg=self.global_avg)


class MetricLogger:
    """Named meters, printed together."""

    def __init__(self, delimiter: str = "\t") -> None:
        self.meters: defaultdict[str, SmoothedValue] = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, **kwargs: Any) -> None:
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                value = value.item()
            self.meters[name].update(value)

    def synchronize_between_processes(self) -> None:
        for meter in self.meters.values():
            meter.synchronize_between_processes()

    def __str__(self) -> str:
        return self.delimiter.join(f"{name}: {meter}" for name, meter in self.meters.items())
