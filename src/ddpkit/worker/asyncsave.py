"""Checkpoints written in the background: ``async_save_checkpoint`` and ``wait_for_checkpoint``.

::

    pending = ddpkit.async_save_checkpoint(directory, state, step=step)  # returns quickly
    ...                                  # training goes on while the main rank writes
    ddpkit.wait_for_checkpoint()         # at the end (or pending.wait()): raises on failure

The loop is blocked only while the state is taken (as in :func:`ddpkit.save_checkpoint`) and
copied to host memory on the main rank, so that the optimizer's next in-place step cannot change
what is written. A thread then writes the copy exactly as the synchronous save does
(:func:`ddpkit.worker.checkpoint.save_payload`: atomic, pruned, loadable like any other).
At most one write is in flight, every wait for it bounded (:mod:`ddpkit.worker.inflight`). The
copy costs host memory the size of the state while the write runs.
"""

from __future__ import annotations

import copy
import functools
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.worker import inflight
from ddpkit.worker.agree import broadcast, describe, world
from ddpkit.worker.checkpoint import collect, save_payload, sharded_parts
from ddpkit.worker.watchdog.flight import patient

__all__ = ["PendingCheckpoint", "async_save_checkpoint", "snapshot", "wait_for_checkpoint"]

# the main rank's last copy, whose memory the next one reuses (its write is over by then)
_SPARE: dict[str, Any] = {}
# values that nothing can change in place: kept, not copied
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


class PendingCheckpoint:
    """A checkpoint being written in the background; ``wait()`` ends it (a collective)."""

    def __init__(self, write: inflight._Write) -> None:
        self._write = write

    @property
    def step(self) -> int:
        """The checkpoint's step."""
        return self._write.step

    def done(self) -> bool:
        """True once this rank has nothing left to wait for (the main rank: the write ended,
        well or not). Not a collective: do not branch collectives on it."""
        return self._write.done.is_set()

    def wait(self, timeout_s: float | None = None) -> Path | None:
        """Wait for the write (at most ``timeout_s``, default the save's); call it on every
        rank. Returns the file's path on the main rank, None on the others; raises
        :class:`CheckpointError` on every rank when the write failed or timed out. Waiting
        again, or after a later save ended this one, returns at once."""
        if timeout_s is not None:
            _check_timeout(timeout_s)
        if inflight._STATE.pending is self._write:
            return inflight.finish(self._write.world_size, timeout_s=timeout_s)
        return self._write.path


@patient()  # the others wait while rank 0 copies the state, maybe minutes: not a hang
def async_save_checkpoint(
    directory: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    step: int,
    keep_last: int = 3,
    timeout_s: float = inflight.WAIT_TIMEOUT_S,
) -> PendingCheckpoint:
    """Save ``state`` as checkpoint ``step`` in the background; call it on every rank.

    Same arguments, files and rules as :func:`ddpkit.save_checkpoint`; returns once the state
    is copied, with the write still running on the main rank. It first ends the save in
    flight, if any (raising :class:`CheckpointError` on every rank when that one failed).
    ``timeout_s`` bounds every later wait for this write.
    """
    _check_timeout(timeout_s)
    if found := sharded_parts(state):
        raise ConfigError(
            f"sharded (FSDP2) state in {sorted(found)} cannot be saved in the background",
            hint="use ddpkit.save_checkpoint for a model wrapped with strategy='fsdp'",
        )
    world_size, rank = world()
    payload = collect(directory, state, step=step, keep_last=keep_last)
    folder = Path(directory)
    copied: dict[str, Any] = {}
    failure: Exception | None = None
    if rank == 0:
        try:
            copied = snapshot(payload, _SPARE.pop("copy", None))
            _SPARE["copy"] = copied
        except Exception as error:  # shared below, as a failed write would be
            failure = error
    outcome = broadcast(world_size, describe(failure))
    if outcome is not None:
        text, hint = outcome
        raise CheckpointError(
            f"the main rank (rank 0) could not copy the state of checkpoint step {step} for "
            f"{directory}: {text}",
            hint=hint
            or "every value in the state must be copyable (copy.deepcopy) and "
            "picklable; the checkpoints already there are untouched",
        ) from failure
    write = functools.partial(save_payload, folder, copied, step, keep_last)
    pending = inflight.start(
        step,
        folder,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        write=write if rank == 0 else None,
    )
    return PendingCheckpoint(pending)


def wait_for_checkpoint(timeout_s: float | None = None) -> Path | None:
    """Wait for the checkpoint written in the background, if any; call it on every rank.

    Returns its path on the main rank (None on the others, or when none is in flight);
    raises :class:`CheckpointError` on every rank when it failed or did not finish within
    ``timeout_s`` (default: the bound given to ``async_save_checkpoint``). Call it before
    the end of training, before ``ddpkit.shutdown()``.
    """
    if timeout_s is not None:
        _check_timeout(timeout_s)
    world_size, _ = world()
    return inflight.finish(world_size, timeout_s=timeout_s)


def snapshot(value: Any, spare: Any = None) -> Any:
    """A copy of ``value`` that later in-place changes to it cannot reach: tensors in host memory
    (shared ones stay shared), containers rebuilt, immutable leaves kept, the rest deep-copied.
    ``spare``: an earlier copy nothing reads any more, whose tensors are reused where shape,
    dtype and strides match (memory already mapped is faster to fill than fresh pages)."""
    copier = _Copier()
    copied = copier.copy(value, spare)
    if torch.cuda.is_available():  # device-to-host copies are done before the write reads
        torch.cuda.synchronize()
    return copied


class _Copier:
    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}  # id of a tensor copied -> its copy
        self.used: set[int] = set()  # spare tensors already holding a copy

    def copy(self, value: Any, spare: Any) -> Any:
        kind = type(value)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if id(value) not in self.memo:
                self.memo[id(value)] = self._tensor(value, spare)
            return self.memo[id(value)]
        if kind is dict or kind is OrderedDict:
            old = spare if type(spare) is kind else {}
            return kind((key, self.copy(item, old.get(key))) for key, item in value.items())
        if kind is list or kind is tuple:
            fits = type(spare) is kind and len(spare) == len(value)
            olds = spare if fits else [None] * len(value)
            return kind(self.copy(item, old) for item, old in zip(value, olds, strict=True))
        if isinstance(value, _IMMUTABLE):
            return value
        return copy.deepcopy(value, self.memo)

    def _tensor(self, tensor: torch.Tensor, spare: Any) -> torch.Tensor:
        source = tensor.detach()
        if (
            type(tensor) is torch.Tensor
            and not tensor.requires_grad
            and type(spare) is torch.Tensor
            and id(spare) not in self.used
            and source.layout == torch.strided
            and spare.device.type == "cpu"
            and (spare.dtype, spare.size(), spare.stride())
            == (source.dtype, source.size(), source.stride())
        ):
            self.used.add(id(spare))
            return spare.copy_(source, non_blocking=spare.is_pinned())
        if source.device.type == "cuda" and source.layout == torch.strided:
            host = torch.empty(source.size(), dtype=source.dtype, pin_memory=True)
            host.copy_(source, non_blocking=True)  # synchronized once, after the last one
        else:
            host = source.to("cpu", copy=True)  # keeps the strides, sparse and quantized too
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(host, requires_grad=tensor.requires_grad)
        return host.requires_grad_() if tensor.requires_grad and tensor.is_leaf else host


def _check_timeout(timeout_s: object) -> None:
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not timeout_s > 0
        or timeout_s == float("inf")
    ):
        raise ConfigError(
            f"timeout_s={timeout_s!r} must be a positive, finite number of seconds",
            hint=f"the default is {inflight.WAIT_TIMEOUT_S:g}; every wait for a write is bounded",
        )
