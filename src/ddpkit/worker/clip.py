"""``ddpkit.clip_grad_norm_(model, max_norm)``: the norm of the gradient the optimizer takes.

After a synced backward, DDP's gradients are the same on every rank: the norm torch computes on
one rank is already the norm of the whole batch's gradient, as one process computes it over the
same samples, with no collective. DataParallel and a plain model hold one gradient. Sharded
gradients (DTensor, under FSDP2) are what torch's ``get_total_norm`` handles: it reduces the
shards' parts across ranks into a replicated DTensor, which ``full_tensor()`` turns into the
plain tensor torch returns, so the same call returns the global norm there.

Inside a :func:`ddpkit.accumulate` window, before its last micro-step, DDP's gradients are this
rank's own, unsynced (syncing them would cost what the window saves): the norm is then that of
the gradient of this rank's samples of the window so far (their mean, as after the window's end,
not the raw sum ``.grad`` holds meanwhile), and clipping scales that partial gradient. At world
size 1 it is exact; across ranks it is a local figure. An FSDP2 window skips its reduce-scatter
only when its micro-steps weigh the same, and its gradients so far are then in FSDP2's unsharded
buffers, not in ``.grad``: clipping there is a :class:`UsageError`. The window that holds a
loader pass's shorter last batch reduce-scatters every micro-step: there it is the norm of every
rank's samples so far. Clip the window's gradient after the block whose ``sync`` is true.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.errors import ConfigError, UsageError
from ddpkit.worker.accumulate import window_progress
from ddpkit.worker.precision import scaled_gradients

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip ``model``'s gradients to a total norm of ``max_norm``; returns the total norm.

    As ``torch.nn.utils.clip_grad_norm_`` (same arguments and return value), for the model
    ``ddpkit.wrap`` returned: the norm is the global one, what a single process computes over
    the same full batch (DDP, DataParallel, a plain model; DTensor gradients reduced across
    ranks). Called inside an accumulation window before its last micro-step, it is the norm of
    this rank's gradient so far, or an error where FSDP2 skipped the sync (see the module doc).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"clip_grad_norm_(model) got {type(model).__name__}, not an nn.Module",
            hint="pass the model ddpkit.wrap returned; for a list of parameters use "
            "torch.nn.utils.clip_grad_norm_",
        )
    if scaled_gradients(model):
        raise UsageError(
            "clip_grad_norm_ on gradients still multiplied by the fp16 loss scale",
            hint="call ddpkit.grad_scaler(model).unscale_(optimizer) first, at the window's "
            "end (torch's order: unscale_, clip, step, update)",
        )
    done, rows, latest = window_progress(model)  # a UsageError where .grad is not readable
    parameters = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    full = getattr(total, "full_tensor", None)  # a DTensor: its shards' parts, reduced
    if full is not None:
        total = full()
    if done and rows != latest:  # .grad holds sum(w_i g_i) / latest; the mean so far is / rows
        total = total * (latest / rows)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach)
    return total
