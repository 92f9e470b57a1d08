"""Mixed precision through one switch: ``ddpkit.wrap(model, precision="bf16" | "fp16" | None)``.

Why a switch on ``wrap`` and not a context or a policy object: Accelerate
(``Accelerator(mixed_precision="bf16")``) and Lightning Fabric (``Fabric(precision="bf16-mixed")``)
both take one string and then run the model's forward under autocast themselves, returning its
outputs in float32, so the loss is computed in float32 outside the model. ``wrap`` is ddpkit's
place for what happens to the model, so the same string goes there, and the loop keeps its shape.

    None     float32 everywhere (the default)
    "bf16"   the forward under ``torch.autocast(<device>, torch.bfloat16)`` (CPU and CUDA); no
             loss scaling: bfloat16 has float32's range
    "fp16"   the forward under float16 autocast, and a loss scaler (``torch.amp.GradScaler``):
             float16's small range makes small gradients underflow to 0 unscaled. Torch runs
             it on CUDA and, slowly on most CPUs, on CPU (which is how it is tested here)

The forward runs under autocast wherever it is called (the wrapper's, the unwrapped module's,
every DataParallel replica's): ``wrap`` gives the bare module a subclass of its own class whose
``forward`` enters autocast and casts the outputs of the low dtype to float32, as Accelerate
does. The parameters, the gradients and the optimizer's state stay float32 ("mixed").

fp16's scaler is one per model: :func:`grad_scaler` returns it (a disabled one, whose calls pass
through, for bf16 and None, so one loop serves every precision). With accumulation, torch's
documented order: ``scaler.scale(loss).backward()`` in each micro-step, and at the window's end
``scaler.unscale_(optimizer)``, ``ddpkit.clip_grad_norm_``, ``scaler.step(optimizer)``,
``scaler.update()``. The scale must not change inside a window (its micro-steps' gradients are
added up): this scaler's ``unscale_``, ``step`` and ``update`` refuse to run while a window is
open, and ``ddpkit.clip_grad_norm_`` refuses gradients that are still scaled.
``save_checkpoint`` stores the scaler's state beside the model's (plain numbers: weights-only
loads take it) and ``load_checkpoint`` restores it.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError, UsageError
from ddpkit.hints import did_you_mean
from ddpkit.worker.accumulate import window_progress
from ddpkit.worker.state_dict import unwrap
from ddpkit.worker.structure import map_tensors

__all__ = ["PRECISIONS", "Scaler", "apply_precision", "grad_scaler", "restore_scalers", "scalers"]

PRECISIONS: dict[str | None, torch.dtype | None] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_AUTOCAST_DEVICES = ("cpu", "cuda")


class Scaler(torch.amp.GradScaler):
    """torch's ``GradScaler`` for one model, which knows that model's accumulation window:
    ``unscale_``, ``step`` and ``update`` refuse to run while it is open (the scale must not
    change between micro-steps whose gradients are added up), and it remembers whether the
    gradients were unscaled since the last ``update`` (what :func:`ddpkit.clip_grad_norm_`
    checks)."""

    def __init__(self, model: nn.Module, device: str, *, enabled: bool) -> None:
        super().__init__(device, enabled=enabled)
        self._model = weakref.ref(model)
        self.unscaled = False

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._check_window("unscale_")
        super().unscale_(optimizer)
        self.unscaled = True

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._check_window("step")
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._check_window("update")
        super().update(new_scale)
        self.unscaled = False

    def _check_window(self, call: str) -> None:
        model = self._model()
        if model is None or not self.is_enabled():
            return
        done, _, _ = window_progress(model)
        if done:
            raise UsageError(
                f"scaler.{call}() with an accumulation window open ({done} micro-steps of it "
                "done): the loss scale must stay the same until the window's gradients are "
                "added up",
                hint="step and update the scaler only after the block whose `sync` is true",
            )


# the bare module -> its scaler (only for models wrap gave a precision)
_SCALERS: weakref.WeakKeyDictionary[nn.Module, Scaler] = weakref.WeakKeyDictionary()


def check_precision(precision: object, device_type: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` on ``device_type``; ConfigError when there is none."""
    if not (precision is None or isinstance(precision, str)) or precision not in PRECISIONS:
        names = [name for name in PRECISIONS if name is not None]
        listed = ", ".join(repr(name) for name in [*names, None])
        raise ConfigError(
            f"precision={precision!r} is not a known precision",
            hint=did_you_mean(str(precision), names, hint=f"choose {listed}", cutoff=0.4),
        )
    if precision is not None and device_type not in _AUTOCAST_DEVICES:
        raise ConfigError(
            f"precision={precision!r} on device type {device_type!r}: ddpkit runs autocast "
            "on cpu and cuda only",
            hint="pass precision=None on this device",
        )
    return PRECISIONS[precision]


def apply_precision(model: nn.Module, dtype: torch.dtype | None, device_type: str) -> nn.Module:
    """``model`` (bare, on its device) with its forward under autocast to ``dtype`` (checked by
    :func:`check_precision`), those outputs cast to float32, its scaler registered; ``model``."""
    if dtype is None:
        return model
    if model in _SCALERS:
        raise ConfigError(
            "precision= given to ddpkit.wrap for a model that already has one",
            hint="wrap a model once; pass the bare module with the precision you want",
        )
    base = type(model)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            output = base.forward(self, *args, **kwargs)
        return map_tensors(output, lambda t: t.float() if t.dtype == dtype else t)

    # A subclass, not an instance attribute: a copy, a DataParallel replica or a deepcopy of
    # the model keeps the autocast forward, bound to itself (an instance's bound method would
    # call the original module).
    forward.__doc__ = base.forward.__doc__
    members = {"forward": forward, "__module__": base.__module__}
    model.__class__ = type(base.__name__, (base,), members)
    _SCALERS[model] = Scaler(model, device_type, enabled=dtype == torch.float16)
    return model


def grad_scaler(model: nn.Module) -> Scaler:
    """The loss scaler of ``model`` (the one ``ddpkit.wrap`` returned): enabled under
    ``precision="fp16"``, disabled otherwise (its ``scale``, ``unscale_``, ``step`` and
    ``update`` then pass through: ``scaler.step(optimizer)`` is ``optimizer.step()``), so one
    loop serves every precision. See the module doc for the order of its calls."""
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"grad_scaler(model) got {type(model).__name__}, not an nn.Module",
            hint="pass the model ddpkit.wrap returned",
        )
    bare = unwrap(model)
    scaler = _SCALERS.get(bare)
    if scaler is None:
        device = next((p.device.type for p in bare.parameters()), "cpu")
        scaler = _SCALERS.setdefault(bare, Scaler(bare, device, enabled=False))
    return scaler


def scaled_gradients(model: nn.Module) -> bool:
    """Whether ``model``'s gradients are still multiplied by its fp16 loss scale."""
    scaler = _SCALERS.get(unwrap(model))
    return scaler is not None and scaler.is_enabled() and not scaler.unscaled


def scalers(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The enabled scalers' states of the models in a checkpoint's ``state``, by key."""
    found: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            scaler = _SCALERS.get(unwrap(value))
            if scaler is not None and scaler.is_enabled():
                found[key] = scaler.state_dict()
    return found


def restore_scalers(saved: Mapping[str, Any], state: MutableMapping[str, Any]) -> None:
    """Load the scalers' states a checkpoint holds into the scalers of ``state``'s models (a
    model without an enabled scaler, e.g. resumed in bf16, ignores its saved scale)."""
    for key, scaler_state in saved.items():
        value = state.get(key)
        if isinstance(value, nn.Module):
            scaler = _SCALERS.get(unwrap(value))
            if scaler is not None and scaler.is_enabled():
                scaler.load_state_dict(dict(scaler_state))
