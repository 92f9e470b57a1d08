"""A small classifier trained with ddpkit: the four calls that make a script distributed.

Runs unchanged as one process (`python examples/train.py`), under
`ddpkit run --nproc-per-node 2 examples/train.py`, under plain `torchrun`, or inside a SLURM step
(`srun python examples/train.py`).

The data is synthetic (Gaussian clusters, generated from a fixed seed), so nothing is downloaded.
The test set deliberately has a size that does not divide by world size x batch size: the
evaluation still counts every sample exactly once, which the last lines print.

With `--checkpoint-dir DIR` the script saves a checkpoint every `--checkpoint-every` steps (model,
optimizer, the loader's position, step, epoch and the epoch's running loss) and, when DIR already
holds one, resumes from it mid-epoch. On CPU every run is deterministic, so a run that was killed
and resumed (e.g. under `ddpkit run --max-restarts 1`) ends with bitwise the same weights as an
uninterrupted one: the last line, `weights sha256: <hex>`, lets any two runs be compared.

The loop also asks `ddpkit.preemption_guard()` after every step whether a stop signal arrived
(SIGUSR2 by default: SLURM's warning before the time limit, or `scancel --signal=USR2`). When
one did, every rank stops after the same step, saves a checkpoint and the job requeues itself
(SLURM) or exits with code 75 (elsewhere); the next run resumes. `--step-delay` slows each step
down, to leave time for sending a signal by hand.

`--strategy` chooses how the model is wrapped: `auto` (the default: DDP across processes,
DataParallel on one machine's several GPUs, the plain model otherwise), `dp`, `ddp`, or `fsdp`
(FSDP2: parameters, gradients and optimizer state sharded across the ranks; its checkpoints
are saved by every rank and resume at any world size).

`--accumulate K` steps the optimizer once per K batches (`ddpkit.accumulate`: DDP syncs the
gradients once per window instead of every batch; an epoch's last, shorter window is synced at
its last batch). A step is then a window: checkpoints and stops happen at a window's end.

`--precision bf16` runs the forward under bfloat16 autocast (`ddpkit.wrap(..., precision=...)`);
`--precision fp16` under float16, with the loss scaler `ddpkit.grad_scaler` returns (which passes
through otherwise, so the loop is the same for every precision; checkpoints carry its scale).
`--compile` compiles the model before DDP wraps it (`torch.compile`'s default backend,
inductor: its first step takes a while; `--compile aot_eager` skips the code generation).
Without these flags the run is the float32 eager one, with the same `weights sha256`.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
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
    model: nn.Module, test: torch.utils.data.DataLoader[Any], device: torch.device
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


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 over the raw bytes of every tensor in ``state_dict`` order (CPU, contiguous).

    Names are left out, so a model hashes the same wrapped in DDP or not. A sharded (FSDP2)
    tensor is gathered whole first: a collective, so every rank calls this.
    """
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # any dtype
        digest.update(raw.numpy().tobytes())
    return digest.hexdigest()


def resume(directory: Path | None, state: dict[str, Any]) -> None:
    """Restore ``state`` in place from the newest checkpoint in ``directory``, if there is one."""
    if directory is None:
        return
    step = ddpkit.load_checkpoint(directory, state, map_location="cpu")  # loss sum stays on CPU
    if step is not None:
        # the saved running loss is every rank's (see save): it counts once, on rank 0
        if ddpkit.current().rank != 0:
            state["loss"] = torch.zeros(2)
        ddpkit.print(f"resumed from {directory} at step {step} (epoch {state['epoch']})")


def save(directory: Path, state: dict[str, Any]) -> None:
    """A checkpoint of ``state`` (a collective). Rank 0 writes it, so the running loss it holds
    is summed over the ranks first; each rank keeps its own running sum meanwhile."""
    total = state["loss"].clone()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
    ddpkit.save_checkpoint(directory, {**state, "loss": total}, step=state["step"])


def maybe_checkpoint(directory: Path | None, state: dict[str, Any], every: int) -> None:
    """Save ``state`` every ``every`` steps (a collective: every rank calls it)."""
    if directory is not None and state["step"] % every == 0:
        save(directory, state)


def stop(directory: Path | None, state: dict[str, Any], guard: ddpkit.PreemptionGuard) -> None:
    """Save where the loop stands, then requeue (SLURM) or exit with code 75; never returns."""
    if directory is None:
        ddpkit.print("stop signal: no --checkpoint-dir, so nothing is saved", file=sys.stderr)
    else:
        save(directory, state)
        ddpkit.print(f"stop signal: saved step {state['step']} in {directory}", file=sys.stderr)
    guard.requeue_and_exit()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--train-size", type=int, default=8000)
    parser.add_argument("--test-size", type=int, default=2001)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--strategy",
        choices=("auto", "dp", "ddp", "fsdp"),
        default="auto",
        help="how ddpkit.wrap wraps the model (default auto: DDP across processes)",
    )
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="save and resume here")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between saves")
    parser.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        metavar="K",
        help="batches per optimizer step (gradient accumulation; DDP syncs once per K)",
    )
    parser.add_argument(
        "--exact-resume",
        action="store_true",
        help="keep DDP's gradient buckets in their first layout (find_unused_parameters=True), "
        "so that a resumed run is bitwise exact at any world size, not only 2",
    )
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp16"],
        default=None,
        help="mixed precision: the forward under autocast (default: float32)",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="torch.compile the model (default backend: inductor)",
    )
    args = parser.parse_args()
    if args.checkpoint_every < 1:
        parser.error(f"--checkpoint-every={args.checkpoint_every} must be at least 1")
    if args.step_delay < 0:
        parser.error(f"--step-delay={args.step_delay} must not be negative")
    if args.accumulate < 1:
        parser.error(f"--accumulate={args.accumulate} must be at least 1")
    return args


def main() -> None:
    args = parse_args()

    ctx = ddpkit.init()
    ddpkit.print(
        f"ddpkit: {ctx.info.launcher}, world size {ctx.world_size}, "
        f"backend {ctx.backend}, device {ctx.device}"
    )
    ddpkit.print(f"hyperparameters: lr {args.lr}, seed {args.seed}, batch size {args.batch_size}")
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)

    classes, dim = 4, 32
    train_set = make_data(args.train_size, classes=classes, dim=dim, seed=1)
    test_set = make_data(args.test_size, classes=classes, dim=dim, seed=2)
    # DDP regroups its gradient buckets after the first backward; a resumed run's first step
    # then sums in the old layout, and with 3+ gloo ranks that rounds differently.
    exact = args.exact_resume and args.strategy in ("auto", "ddp")  # a DDP option only
    ddp = {"find_unused_parameters": True} if exact else {}
    compile_options = {"backend": args.compile} if args.compile else False
    model = ddpkit.wrap(
        make_model(dim, classes),
        args.strategy,
        precision=args.precision,
        compile=compile_options,
        **ddp,
    )
    scaler = ddpkit.grad_scaler(model)  # fp16's loss scaler; its calls pass through otherwise
    train = ddpkit.loader(train_set, args.batch_size, shuffle=True, seed=args.seed)
    test = ddpkit.loader(test_set, args.batch_size, shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    # Everything a resumed run needs to continue exactly where this one stopped; "loss" is the
    # epoch's running sum (loss x samples, samples), so a resumed epoch prints the same loss.
    state: dict[str, Any] = {
        "model": model, "optimizer": optimizer, "train": train,
        "step": 0, "epoch": 0, "loss": torch.zeros(2),
    }  # fmt: skip
    resume(args.checkpoint_dir, state)
    guard = ddpkit.preemption_guard()  # SIGUSR2 (or DDPKIT_SIGNAL): stop, save, requeue

    start = time.perf_counter()
    for epoch in range(state["epoch"], args.epochs):
        if epoch != state["epoch"]:  # a new epoch, not the one a checkpoint resumed mid-way
            state["epoch"], state["loss"] = epoch, torch.zeros(2)
        # A new pass (the loader advances its epoch by itself), with a progress bar on the main
        # rank when stderr is a terminal (silent in logs, or with DDPKIT_PROGRESS=0).
        for features, labels in ddpkit.progress(train, f"epoch {epoch}"):
            features, labels = features.to(ctx.device), labels.to(ctx.device)
            # forward and backward of one micro-step; DDP syncs only on a window's last one,
            # and ddpkit scales the gradients then (the loss is not divided by K)
            with ddpkit.accumulate(model, every=args.accumulate) as micro:
                loss = loss_fn(model(features), labels)
                scaler.scale(loss).backward()
            state["loss"] += torch.tensor([loss.item() * len(labels), len(labels)])
            time.sleep(args.step_delay)
            if not micro.sync:
                continue  # the optimizer steps once per window of K batches
            scaler.step(optimizer)  # optimizer.step(), skipped by fp16 on inf/nan gradients
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            # at a window's end only: a checkpoint holds no half-accumulated gradients
            maybe_checkpoint(args.checkpoint_dir, state, args.checkpoint_every)
            if guard.should_stop():  # a collective: every rank stops after the same step
                stop(args.checkpoint_dir, state, guard)
        total = state["loss"].clone()
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
    digest = weights_sha256(model)  # on every rank: a collective under fsdp
    ddpkit.print(f"weights sha256: {digest}")  # the last line: compare runs


if __name__ == "__main__":
    main()
