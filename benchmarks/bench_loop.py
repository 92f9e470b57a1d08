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
says so. Two models: ``small`` (a 32-128-128-4 MLP: per-step overhead shows) and ``large`` (a
256-1024-1024-1024-4 MLP, 2.4 M parameters: gradient all-reduce dominates).

A trial trains one epoch of every variant, interleaved: a few steps of one variant, then a few of
the next (the first one rotating from round to round), each stretch timed between two barriers,
until every epoch is done. Machine noise lasts longer than a stretch (tens of milliseconds), so it
hits all variants alike: timed epoch after epoch instead, on this shared 2-core machine, the same
variant's rate moved by 30 % from trial to trial, more than the goal's margin. Half the trials run
on variants built in the listed order, half on variants built again in reverse (the variant built
first ran faster). Rank 0 prints samples/s per trial, the medians and the ratio ddpkit / plain:
the median of the trials' ratios (goal: >= 0.98).

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
from collections.abc import Callable, Iterable, Iterator

import benchjson
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit

# report-launcher: ddpkit run --nproc-per-node 2

MODELS = {  # name: (layer widths, samples per epoch, quick samples)
    "small": ([32, 128, 128, 4], 65536, 4096),
    "large": ([256, 1024, 1024, 1024, 4], 4096, 512),
}
CNN_SAMPLES = (16384, 1024)  # samples per epoch, quick samples
PEERS = {"accelerate": "accelerate", "lightning fabric": "lightning_fabric"}
DEVICE = torch.device("cpu")  # set by main() from --device

Epoch = Callable[[], Iterator[int]]  # one epoch, step by step: the samples of each step
STRETCH_S = 0.05  # about how long one variant trains before the next takes over


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
) -> Iterator[int]:  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    for x, y in batches:
        x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        backward(loss_fn(model(x), y))
        opt.step()
        yield len(y)


def interleaved(epochs: dict[str, Epoch], order: list[str], steps: int) -> dict[str, float]:
    """One trial: samples per second over all ranks of each variant's epoch, ``steps`` steps of
    one variant at a time in turn (``order`` first, rotating each round), each stretch timed
    between barriers. Every rank runs the same number of steps an epoch (the samplers pad)."""
    running = {v: epochs[v]() for v in order}
    busy, seen = dict.fromkeys(order, 0.0), dict.fromkeys(order, 0)
    for turn in itertools.count():
        live = [v for v in order if v in running]
        if not live:
            break
        for variant in live[turn % len(live) :] + live[: turn % len(live)]:
            sync()
            start = time.perf_counter()
            done = list(itertools.islice(running[variant], steps))
            sync()
            busy[variant] += time.perf_counter() - start
            seen[variant] += sum(done)
            if len(done) < steps:
                del running[variant]
    totals = torch.tensor([float(seen[v]) for v in order], device=DEVICE)
    dist.all_reduce(totals)
    return {v: float(total) / busy[v] for v, total in zip(order, totals.tolist(), strict=True)}


def stretch_steps(epochs: dict[str, Epoch], batch: int) -> int:
    """Steps of about :data:`STRETCH_S`, from a warm-up epoch of each variant (the slowest)."""
    rates = [timed(epoch) for epoch in epochs.values()]
    steps_per_s = min(rates) / dist.get_world_size() / batch
    return max(2, round(steps_per_s * STRETCH_S))


def timed(epoch: Epoch) -> float:
    """Samples per second over all ranks for one epoch, timed whole."""
    sync()
    start = time.perf_counter()
    seen = torch.tensor(sum(epoch()), device=DEVICE)
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

    def epoch() -> Iterator[int]:
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
) -> tuple[dict[str, list[float]], list[float]]:
    widths, samples, quick_samples = MODELS[name] if name != "cnn" else ([], *CNN_SAMPLES)
    samples = quick_samples if args.quick else samples
    gen = torch.Generator().manual_seed(0)
    shape, classes = ((3, 64, 64), 10) if name == "cnn" else ((widths[0],), widths[-1])
    data = TensorDataset(
        torch.randn(samples, *shape, generator=gen),
        torch.randint(0, classes, (samples,), generator=gen),
    )
    rates: dict[str, list[float]] = {v: [] for v in variants}
    ratios: list[float] = []  # ddpkit / plain torch, trial by trial
    # On this shared 2-core machine the variant built first ran faster (plain torch built
    # first: ddpkit 0.93-0.95 of it; ddpkit built first: 1.01): the even trials run on
    # variants built in the listed order, the odd ones on variants built again in reverse.
    for half, order in enumerate((variants, variants[::-1])):
        epochs = {v: VARIANTS[v](ctx, widths, data, args.batch_size) for v in order}
        steps = stretch_steps(epochs, args.batch_size)  # also the warm-up
        for trial in range(half, args.trials, 2):
            # Rotate which variant goes first so none always runs on a warmer machine.
            shift = trial % len(variants)
            rate = interleaved(epochs, variants[shift:] + variants[:shift], steps)
            for variant in variants:
                rates[variant].append(rate[variant])
            ratios.append(rate["ddpkit"] / rate["plain torch"])
            shown = "   ".join(f"{v} {rate[v]:9.0f} samples/s" for v in variants)
            ddpkit.print(f"{name} model, trial {trial} ({steps} steps a turn): {shown}")
        del epochs
        gc.collect()
    return rates, ratios


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
        rates, ratios = bench_model(ctx, name, variants, args)
        medians = {v: statistics.median(rates[v]) for v in variants}
        p, k = medians["plain torch"], medians["ddpkit"]
        ratio = statistics.median(ratios)
        ddpkit.print(
            f"{name} model, median: plain torch DDP {p:.0f} samples/s, ddpkit {k:.0f} samples/s, "
            f"ratio ddpkit/plain {ratio:.3f} (median of {len(ratios)} trials' ratios, "
            f"{min(ratios):.3f} to {max(ratios):.3f}; goal >= 0.98)"
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
        notes.append(
            f"{figure}: ddpkit / plain torch {ratio:.3f}, the median of {len(ratios)} trials' "
            f"ratios ({', '.join(f'{r:.3f}' for r in ratios)}; goal >= 0.98)"
        )
    for note in notes:
        ddpkit.print(note)
    if ctx.rank == 0:
        benchjson.write(
            args.json, "loop", "Training loop: the same loop in plain torch DDP, ddpkit and peers",
            f"ddpkit run --nproc-per-node {ctx.world_size}", rows, notes=notes,
        )  # fmt: skip


if __name__ == "__main__":
    main()
