"""Gradient accumulation: ``with ddpkit.accumulate(model, every=k):`` around each micro-step.

A window is up to ``k`` micro-steps (forward and backward inside the block). On every
micro-step but the window's last, the wrapper's gradient sync is skipped (DDP's ``no_sync``,
FSDP2's ``set_requires_gradient_sync(False)``), so ranks all-reduce (or reduce-scatter) once per
window instead of once per micro-step (accelerate PR #1153: 2.2x slower across nodes without
it). The window's last micro-step syncs, and on leaving it the
gradients are divided so that they equal those of one batch made of the window's micro-batches.
A plain model or DataParallel has no sync to skip: the window is only a counter there, with the
same gradients and the same ``sync`` flag, so one loop serves every strategy.

**Do not divide the loss by k.** ddpkit scales the gradients itself, by the samples each
micro-step held: a mean-reduced loss per micro-step gives, at the window's end, the mean over
every sample of the window. Accelerate divides the loss by ``k`` in ``backward()``, which
under-weights a window cut short at the end of an epoch; here the window's own micro-steps and
rows count. Between micro-steps ``.grad`` holds the sum of the micro-steps' gradients (each
relative to the latest micro-batch's size); only the window's last micro-step leaves the mean.

The epoch's end: inside a ``ddpkit.loader`` loop, the pass's last batch ends the window (synced
at that micro-step, however many micro-steps it held), and the loader's rows weigh each
micro-step (the last batch is often shorter). With another iterable, or a loop that splits each
loader batch into several micro-steps (seen at the second micro-step on one batch), every
micro-step weighs the same and ``last=True`` ends a window early.

A DDP made with ``static_graph=True`` records its graph at its first backward, which must
sync (torch asserts otherwise): the model's first micro-step syncs, whatever its place in the
window. The window's gradients are the same (the all-reduce's mean of a synced part adds up
with the others to the same mean), one all-reduce more.

A wrapper skips its sync as :func:`_skipper` says: DDP's ``no_sync()``, FSDP2's
``set_requires_gradient_sync(False)``. A skipped DDP micro-step leaves its gradients in
``.grad``, where a micro-step of another size rescales them. A skipped FSDP2 micro-step leaves
them unsharded in FSDP2's own buffers until the synced one reduce-scatters them into the
sharded ``.grad`` (DTensors, which ``compat.foreach_mul_`` scales too): out of reach of that
rescaling, and of ``clip_grad_norm_`` (reading them mid-window is a :class:`UsageError`). So an
FSDP2 window decides at its first micro-step: it skips the sync only if every micro-step it can
hold weighs the same (no loader, a loop that splits its batches, or the loader's rows equal up
to the window's end, which the loader's layout knows in advance); the window holding a pass's
shorter last batch reduce-scatters every micro-step instead, which is exact. A loop that jumps
batches into such a window anyway gets a :class:`UsageError`, not wrong gradients.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ddpkit import compat
from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker.loader import active_pass
from ddpkit.worker.state_dict import unwrap

__all__ = ["MicroStep", "accumulate", "window_progress"]


@contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's ``no_sync``: a backward inside keeps its unsharded gradients (no reduce-scatter)."""
    root = cast(FSDPModule, unwrap(model))
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


@dataclass(frozen=True)
class MicroStep:
    """What ``with ddpkit.accumulate(...) as step`` says about the micro-step it wraps.

    ``sync``: this micro-step ends its window: its backward syncs the gradients, and after the
    block they are the window's; step the optimizer (and zero the gradients) then.
    ``index``: the micro-step's place in its window, from 0. ``every``: the window's size as
    given (a window cut by the epoch's end holds fewer).
    """

    sync: bool
    index: int
    every: int


@dataclass
class _Window:
    """The open window of one model (keyed by the model under its wrappers)."""

    micro_steps: int = 0  # completed micro-steps of the open window
    rows: float = 0.0  # their weights (a loader's rows, else 1 each) added up
    latest: float = 1.0  # the latest micro-step's weight: .grad holds sum(w_i g_i) / latest
    batch: tuple[weakref.ref[Any], int] | None = None  # (loader pass, step) of the latest one
    follows_loader: bool = True  # False once two micro-steps shared a loader batch
    checked: bool = False  # a backward was seen inside the block (checked once per model)
    synced: bool = False  # a micro-step synced (a static-graph DDP must sync its first one)
    skips: bool = False  # the open window skips the sync of its micro-steps but the last
    hidden: bool = False  # a skipped micro-step left its gradients outside .grad (FSDP2)
    inside: bool = False  # a micro-step's block is running


_WINDOWS: weakref.WeakKeyDictionary[nn.Module, _Window] = weakref.WeakKeyDictionary()


@contextmanager
def accumulate(model: nn.Module, every: int, *, last: bool = False) -> Iterator[MicroStep]:
    """One micro-step of a window of ``every``: run forward *and* backward inside the block.

    The gradient sync is skipped on every micro-step but the window's last one (the
    ``every``-th, the last batch of a ``ddpkit.loader`` pass, or one entered with
    ``last=True``); after that block the gradients equal those of one batch made of the
    window's micro-batches (do not divide the loss by ``every``). Yields a :class:`MicroStep`:
    step the optimizer when its ``sync`` is true. Works the same on DDP, FSDP2, DataParallel and a
    plain model; ``every=1`` is an ordinary loop.
    """
    _check(model, every)
    window = _WINDOWS.setdefault(unwrap(model), _Window())
    weight, ends_pass = _loader_batch(window)
    sync = last or ends_pass or window.micro_steps + 1 >= every
    skipper, hidden = _skipper(model)
    if not window.micro_steps:  # a new window: does it skip? (FSDP2's only if uniform)
        window.skips = skipper is not None and (not hidden or _uniform(window, every))
    if window.micro_steps and weight != window.latest:
        if window.hidden:
            raise UsageError(
                f"a micro-step of {weight:g} rows in an FSDP2 accumulation window of "
                f"{window.latest:g}-row micro-steps whose sync was skipped: their gradients "
                "are in FSDP2's unsharded buffers, out of reach of the rescaling",
                hint="run one micro-step per ddpkit.loader batch, in order (the window then "
                "knows its batches' sizes in advance), or end the window with last=True "
                "before a batch of another size",
            )
        _scale(model, window.latest / weight)  # .grad now holds sum(w_i g_i) / weight
    window.latest = weight
    # DDP(static_graph=True) records its graph at its first backward, which must sync;
    # an extra sync inside a window changes no gradient (a mean of means is the mean)
    skip = window.skips and not sync and (window.synced or not compat.ddp_static_graph(model))
    hides = skip and hidden  # .grad stays as it was
    marks = None if window.checked or hides else _grad_marks(model)
    step = MicroStep(sync=sync, index=window.micro_steps, every=every)
    window.inside = True
    try:
        with skipper() if skip and skipper is not None else nullcontext():
            yield step
    finally:
        window.inside = False
    if marks is not None:
        if marks == _grad_marks(model):
            raise UsageError(
                "no gradient was computed inside `with ddpkit.accumulate(...)`",
                hint="call loss.backward() inside the block: the block decides whether that "
                "backward syncs, and scales the gradients when the window ends",
            )
        window.checked = True
    window.micro_steps += 1
    window.rows += weight
    window.synced = window.synced or not skip
    window.hidden = window.hidden or hides
    if sync:
        if window.rows != weight:
            _scale(model, weight / window.rows)  # the window's mean over its rows
        window.micro_steps, window.rows, window.latest = 0, 0.0, 1.0
        window.hidden = False


def window_progress(model: nn.Module) -> tuple[int, float, float]:
    """The open window of ``model``: (micro-steps done, their weights added up, the latest
    one's weight); (0, 0.0, 1.0) between windows. ``.grad`` then holds the window's mean so
    far times ``weights / latest`` (what :func:`ddpkit.clip_grad_norm_` corrects for).
    Inside a micro-step's block the gradients are neither: a :class:`UsageError`; so too in an
    FSDP2 window whose sync was skipped (its gradients so far are not in ``.grad``)."""
    window = _WINDOWS.get(unwrap(model))
    if window is None:
        return 0, 0.0, 1.0
    if window.inside:
        raise UsageError(
            "the gradients were read inside `with ddpkit.accumulate(...)`",
            hint="clip (and step the optimizer) after the block: on the window's last "
            "micro-step, leaving the block is what makes the gradients the window's",
        )
    if window.hidden:
        raise UsageError(
            "the gradients were read inside an FSDP2 accumulation window: its micro-steps so "
            "far skipped their reduce-scatter, their gradients are in FSDP2's unsharded "
            "buffers, not in .grad",
            hint="clip (and step the optimizer) after the block whose `sync` is true",
        )
    return window.micro_steps, window.rows, window.latest


def _check(model: object, every: object) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"accumulate(model) got {type(model).__name__}, not an nn.Module",
            hint="pass the model ddpkit.wrap returned",
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(
            f"accumulate(every={every!r}) must be a positive int",
            hint="the number of micro-steps per optimizer step, e.g. every=8 (1: no accumulation)",
        )


def _skipper(model: nn.Module) -> tuple[Callable[[], AbstractContextManager[Any]] | None, bool]:
    """(a context in which ``model``'s backward does not sync, or None: a plain model or
    DataParallel has nothing to skip; whether a skipped micro-step's gradients stay outside
    ``.grad`` until the window's synced one, so that its window skips only if uniform)."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync, False
    if isinstance(unwrap(model), FSDPModule):
        return lambda: _fsdp_no_sync(model), True
    return None, False


def _uniform(window: _Window, every: int) -> bool:
    """Whether every micro-step of the window opening now weighs the same: the loader's rows
    from this batch to the window's end (``every`` batches on, or the pass's end), else 1.0
    each (no loader, or a loop that splits its batches: see :func:`_loader_batch`)."""
    iterator = active_pass()
    if iterator is None or window.batch is None or not window.follows_loader:
        return True
    layout = iterator.loader.layout
    end = min(iterator.step + every, layout.steps)
    return len({layout.rows(step) for step in range(iterator.step, end)}) <= 1


def _loader_batch(window: _Window) -> tuple[float, bool]:
    """(this micro-step's weight, whether its batch is its pass's last): a ``ddpkit.loader``'s
    rows and end when one yielded a batch since the previous micro-step, else (1.0, False)."""
    iterator = active_pass()
    if iterator is None or not window.follows_loader:
        window.batch = None
        return 1.0, False
    step = iterator.step
    previous, window.batch = window.batch, (weakref.ref(iterator), step)
    if previous is not None and previous[1] == step and previous[0]() is iterator:
        # The same batch again: the loop splits a batch into micro-steps (or iterates
        # something else inside a loader pass). From now on every micro-step weighs the same;
        # the one before, weighed by the batch's rows, becomes one of them (.grad holds
        # sum(w_i g_i) / latest, which for a single micro-step is its gradient either way).
        window.follows_loader = False
        if window.micro_steps == 1:
            window.rows, window.latest = 1.0, 1.0
        return 1.0, False
    layout = iterator.loader.layout
    return float(layout.rows(step)), step == layout.steps - 1


def _scale(model: nn.Module, factor: float) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        compat.foreach_mul_(grads, factor)


def _grad_marks(model: nn.Module) -> list[tuple[int, int]]:
    """Which gradient tensor each parameter holds and its in-place version: a backward
    changes one of them (a new tensor, or an accumulation into the old one; FSDP2 adds into a
    DTensor's local shard, whose version is the one that moves)."""
    return [
        (-1, -1) if p.grad is None else (id(p.grad), _local(p.grad)._version)
        for p in model.parameters()
    ]


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad
