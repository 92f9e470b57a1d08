"""Training-loop throughput: ddpkit vs the same loop in plain torch DDP, Accelerate and Fabric.

Launch with two processes, e.g.::

    ddpkit run --nproc-per-node 2 benchmarks/bench_loop.py [--trials 7] [--model small|large|both]
    torchrun --nproc-per-node 2 benchmarks/bench_loop.py      # same figures
    ddpkit run --nproc-per-node 1 benchmarks/bench_loop.py --device cuda --model cnn   # a GPU

Every variant writes the same loop (model, data, per-rank batch size, SGD, one epoch per
trial) its own way, in one process group: plain torch (``DistributedDataParallel``,
``DistributedSampler`` and ``set_epoch`` by hand), ddpkit (``wrap``, ``loader``), Hugging Face
Accelerate (``Accelerator.prepare``, ``accelerator.backward``) and Lightning Fabric
(``fabric.setup``, ``setup_dataloaders``, ``fabric.backward``). Accelerate and Fabric are
optional (``pip install ddpkit[bench]``): a peer that is not installed has no row, and a note
says so. The variants run in turn, the first one rotating from trial to trial, so that machine
noise hits all alike. Two models: ``small`` (a 32-128-128-4 MLP: per-step overhead shows) and
``large`` (a 256-1024-1024-1024-4 MLP, 2.4 M parameters: gradient all-reduce dominates).
Rank 0 prints samples/s per trial, the medians and the ratios ddpkit / plain (goal: >= 0.98).

On a GPU (``--device cuda``, one or more processes, one GPU each) the ``cnn`` model keeps the
device busy: a ResNet-style network (a stem and four residual stages with BatchNorm, 64-512
channels, 4.9 M parameters, on 3x64x64 synthetic images, 10 classes); the batches are moved to
the GPU in the loop by every variant alike, and the timing waits for the GPU
(``torch.cuda.synchronize``). At world size 1, ``ddpkit.wrap`` and Accelerate leave the model
unwrapped while plain torch and Fabric (``strategy="ddp"``) keep ``DistributedDataParallel``:
that is what each gives its users, and the figure says so.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import statistics
import time
from collections.abc import Callable, Iterable

import benchjson
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit

# report-launcher: ddpkit run --nproc-per-node 2

MODELS = {  # name: (layer widths, samples per epoch, quick samples)
    "small": ([32, 128, 128, 4], 16384, 4096),
    "large": ([256, 1024, 1024, 1024, 4], 4096, 512),
}
CNN_SAMPLES = (16384, 1024)  # samples per epoch, quick samples
PEERS = {"accelerate": "accelerate", "lightning fabric": "lightning_fabric"}
DEVICE = torch.device("cpu")  # set by main() from --device

Epoch = Callable[[], int]  # one epoch; returns the samples this rank trained on


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm, a shortcut around them."""

    def __init__(self, width_in: int, width_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(width_in, width_out, 3, stride, 1, bias=False), nn.BatchNorm2d(width_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(width_out, width_out, 3, 1, 1, bias=False), nn.BatchNorm2d(width_out),
        )  # fmt: skip
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or width_in != width_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(width_in, width_out, 1, stride, bias=False), nn.BatchNorm2d(width_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    stages = [Block(64, 64, 1), Block(64, 128, 2), Block(128, 256, 2), Block(256, 512, 2)]
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10),
    )  # fmt: skip


def make_model(widths: list[int]) -> nn.Module:
    if not widths:
        return make_cnn()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def run_epoch(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    opt: torch.optim.Optimizer, backward: Callable[[torch.Tensor], None],
) -> int:  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    seen = 0
    for x, y in batches:
        x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        backward(loss_fn(model(x), y))
        opt.step()
        seen += len(y)
    return seen


def timed(epoch: Callable[[], int]) -> float:
    """Samples per second over all ranks for one epoch."""
    sync()
    start = time.perf_counter()
    seen = torch.tensor(epoch(), device=DEVICE)
    sync()
    elapsed = time.perf_counter() - start
    dist.all_reduce(seen)
    return float(seen) / elapsed


def sync() -> None:
    """Wait for this rank's GPU work, then for every rank."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    dist.barrier()


def plain_variant(ctx: ddpkit.Context, widths: list[int], data: TensorDataset, batch: int) -> Epoch:
    on_gpu = DEVICE.type == "cuda"
    model = DistributedDataParallel(
        make_model(widths).to(DEVICE), device_ids=[DEVICE] if on_gpu else None
    )
    sampler = DistributedSampler(
        data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0
    )
    loader = DataLoader(data, batch_size=batch, sampler=sampler, pin_memory=on_gpu)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = iter(range(1, 1_000_000))

    def epoch() -> int:
        sampler.set_epoch(next(epochs))  # what everyone has to remember by hand
        return run_epoch(model, loader, opt, torch.Tensor.backward)

    return epoch


def ddpkit_variant(
    ctx: ddpkit.Context, widths: list[int], data: TensorDataset, batch: int
) -> Epoch:
    model = ddpkit.wrap(make_model(widths))
    loader = ddpkit.loader(data, batch, shuffle=True, seed=0, pin_memory=DEVICE.type == "cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return lambda: run_epoch(model, loader, opt, torch.Tensor.backward)


def accelerate_variant(
    ctx: ddpkit.Context, widths: list[int], data: TensorDataset, batch: int
) -> Epoch:
    from accelerate import Accelerator

    on_gpu = DEVICE.type == "cuda"
    accelerator = Accelerator(cpu=not on_gpu)  # adopts the existing process group
    model = make_model(widths)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = accelerator.prepare(
        model, opt, DataLoader(data, batch_size=batch, shuffle=True, pin_memory=on_gpu)
    )
    return lambda: run_epoch(model, loader, opt, accelerator.backward)


def fabric_variant(
    ctx: ddpkit.Context, widths: list[int], data: TensorDataset, batch: int
) -> Epoch:
    try:
        from lightning_fabric import Fabric
    except ImportError:  # the ``lightning`` package ships it as lightning.fabric
        from lightning.fabric import Fabric

    accelerator = "cuda" if DEVICE.type == "cuda" else "cpu"
    devices = 1 if accelerator == "cuda" else ctx.world_size  # one GPU per process
    nodes = ctx.world_size // devices
    fabric = Fabric(accelerator=accelerator, devices=devices, num_nodes=nodes, strategy="ddp")
    fabric.launch()  # under torchrun/ddpkit run: adopts the existing process group
    model = make_model(widths)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(
        DataLoader(data, batch_size=batch, shuffle=True, pin_memory=accelerator == "cuda")
    )
    return lambda: run_epoch(model, loader, opt, fabric.backward)


VARIANTS = {
    "plain torch": plain_variant,
    "ddpkit": ddpkit_variant,
    "accelerate": accelerate_variant,
    "lightning fabric": fabric_variant,
}


def bench_model(
    ctx: ddpkit.Context, name: str, variants: list[str], args: argparse.Namespace
) -> dict[str, list[float]]:
    widths, samples, quick_samples = MODELS[name] if name != "cnn" else ([], *CNN_SAMPLES)
    samples = quick_samples if args.quick else samples
    gen = torch.Generator().manual_seed(0)
    shape, classes = ((3, 64, 64), 10) if name == "cnn" else ((widths[0],), widths[-1])
    data = TensorDataset(
        torch.randn(samples, *shape, generator=gen),
        torch.randint(0, classes, (samples,), generator=gen),
    )
    rates: dict[str, list[float]] = {v: [] for v in variants}
    # On this shared 2-core machine the variant built first ran faster (plain torch built
    # first: ddpkit 0.93-0.95 of it; ddpkit built first: 1.01): the even trials run on
    # variants built in the listed order, the odd ones on variants built again in reverse.
    for half, order in enumerate((variants, variants[::-1])):
        epochs = {v: VARIANTS[v](ctx, widths, data, args.batch_size) for v in order}
        for epoch in epochs.values():
            timed(epoch)  # warm-up
        for trial in range(half, args.trials, 2):
            # Rotate which variant goes first so none always runs on a warmer machine.
            shift = trial % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                rates[variant].append(timed(epochs[variant]))
            shown = "   ".join(f"{v} {rates[v][-1]:9.0f} samples/s" for v in variants)
            ddpkit.print(f"{name} model, trial {trial}: {shown}")
        del epochs
        gc.collect()
    return rates


def installed(module: str) -> bool:
    """``module`` importable, or its ``lightning.fabric``-style home (``lightning_fabric``)."""
    try:
        return any(importlib.util.find_spec(m) for m in (module, module.replace("_", ".")))
    except ImportError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", choices=[*MODELS, "both", "cnn"], default="both")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--no-peers", action="store_true", help="plain torch and ddpkit only")
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.trials = min(args.trials, 2)

    global DEVICE  # noqa: PLW0603  (the script's one setting, read by its helpers)
    ctx = ddpkit.init(device="cuda" if args.device == "cuda" else "cpu")
    DEVICE = ctx.device
    if ctx.world_size < 2 and DEVICE.type != "cuda":
        raise SystemExit("run me with at least 2 processes: ddpkit run --nproc-per-node 2 ...")
    variants, notes = ["plain torch", "ddpkit"], []
    for peer, module in PEERS.items():
        if args.no_peers:
            notes.append(f"{peer}: not run (--no-peers)")
        elif not installed(module):
            notes.append(f"{peer}: not installed (pip install ddpkit[bench])")
        else:
            variants.append(peer)
    rows = []
    for name in [*MODELS] if args.model == "both" else [args.model]:
        rates = bench_model(ctx, name, variants, args)
        medians = {v: statistics.median(rates[v]) for v in variants}
        p, k = medians["plain torch"], medians["ddpkit"]
        ddpkit.print(
            f"{name} model, median: plain torch DDP {p:.0f} samples/s, ddpkit {k:.0f} samples/s, "
            f"ratio ddpkit/plain {k / p:.3f} (goal >= 0.98)"
        )
        for peer in variants[2:]:
            ddpkit.print(f"{name} model, median: {peer} {medians[peer]:.0f} samples/s, "
                         f"ratio ddpkit/{peer} {k / medians[peer]:.3f}")  # fmt: skip
        if name == "cnn":
            gpu = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU"
            figure = f"training loop, ResNet-style CNN on {gpu}, {ctx.world_size} ranks"
        else:
            widths = "-".join(map(str, MODELS[name][0]))
            figure = f"training loop, {name} model (MLP {widths}), {ctx.world_size} ranks"
        rows += [
            benchjson.row(figure, v, medians[v], "samples/s", True, trials=rates[v])
            for v in variants
        ]
    for note in notes:
        ddpkit.print(note)
    if ctx.rank == 0:
        benchjson.write(
            args.json, "loop", "Training loop: the same loop in plain torch DDP, ddpkit and peers",
            f"ddpkit run --nproc-per-node {ctx.world_size}", rows, notes=notes,
        )  # fmt: skip


if __name__ == "__main__":
    main()
