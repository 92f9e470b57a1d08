"""``wrap(model, "fsdp")``: torch's FSDP2 (``fully_shard``) per block, then on the root.

Each *block* becomes one FSDP2 unit: its parameters are sharded across the ranks at rest and
all-gathered only while that block runs forward or backward, so a rank holds about ``1/N`` of
the parameters, gradients and optimizer state, plus one block unsharded at a time. The root
unit takes every parameter left outside a block (embeddings, a head).

Which modules are blocks:

    fsdp_blocks=(Block, ...)  every submodule that is an instance of one of these classes
                              (the outermost one where they nest): a transformer's layer
                              class, as Accelerate's and torchtitan's wrap policies name it
    fsdp_blocks=None          the size rule: walking the tree bottom-up, a submodule becomes a
                              block when the parameters it holds outside the blocks already
                              chosen below it reach 1/8 of the model's (FSDP1's size-based
                              policy, with a threshold relative to the model so that a small
                              model splits into units too); a module with no parameters of its
                              own around one child is chosen instead of that child (a layer,
                              not the Linear inside it); at most 8 blocks, so the all-gathers
                              stay few and large, and never the root itself

The argument is named for the strategy (``fsdp_``) because ``wrap``'s other keywords go to
DDP, and a name that says which strategy reads it cannot be mistaken for a DDP option.

``wrap``'s ``precision`` switch, under ``"fsdp"``: ``None`` keeps every dtype as it is;
``"bf16"`` is torch's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: forward and backward in
bf16 on the all-gathered copy, gradients reduced in fp32, and the sharded parameters the
optimizer steps stay fp32. ``"fp16"`` would need a sharded gradient scaler: refused.

``wrap``'s ``compile`` switch, under ``"fsdp"``: each block is compiled in place
(``nn.Module.compile``) before ``fully_shard``, as torchtitan compiles its transformer
blocks: FSDP2's all-gather and reduce-scatter hooks stay outside the compiled graphs (dynamo
skips FSDP's hooks by default), the parameters' names and the checkpoints' keys do not change
(no ``_orig_mod.``), and the root's own layers (embeddings, a head) run eagerly. A model with
no block (one unit) is compiled whole, the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ddpkit.errors import ConfigError
from ddpkit.hints import did_you_mean

__all__ = ["FSDP_PRECISIONS", "choose_blocks", "fsdp_policy", "is_sharded", "shard_model"]

FSDP_PRECISIONS: tuple[str, ...] = ("bf16",)
_SIZE_SHARE = 8  # the size rule: a block holds at least 1/_SIZE_SHARE of the parameters


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2-sharded parameters (DTensors): its state is saved through
    torch.distributed.checkpoint, one shard per rank."""
    return isinstance(model, FSDPModule) or any(
        isinstance(parameter, DTensor) for parameter in model.parameters()
    )


def check_blocks(blocks: object) -> tuple[type[nn.Module], ...] | None:
    """``fsdp_blocks`` as a tuple of module classes, or None; ConfigError for anything else."""
    if blocks is None:
        return None
    items = (blocks,) if isinstance(blocks, type) else blocks
    if isinstance(items, str | bytes) or not isinstance(items, Sequence | set | frozenset):
        raise ConfigError(
            f"fsdp_blocks={blocks!r} must be a tuple of nn.Module classes",
            hint="name your repeated layer class, e.g. fsdp_blocks=(TransformerBlock,), or "
            "leave it None for the size rule",
        )
    found = tuple(items)
    for item in found:
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise ConfigError(
                f"fsdp_blocks holds {item!r}, which is not an nn.Module class",
                hint="pass the class itself (fsdp_blocks=(Block,)), not an instance or its name",
            )
    if not found:
        raise ConfigError(
            "fsdp_blocks=() names no class",
            hint="name at least one block class, or pass None for the size rule",
        )
    return found


def fsdp_policy(precision: object) -> MixedPrecisionPolicy:
    """The FSDP2 policy for ``wrap(..., "fsdp", precision=...)``; ConfigError for a value it
    cannot serve."""
    if precision is None:
        return MixedPrecisionPolicy()  # torch's default: every dtype as it is
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp16":
        raise ConfigError(
            "precision='fp16' with strategy='fsdp': float16 needs a sharded gradient scaler, "
            "which ddpkit does not provide",
            hint="use precision='bf16' (no scaler needed), or strategy='ddp' for fp16",
        )
    listed = ", ".join(repr(choice) for choice in (*FSDP_PRECISIONS, None))
    raise ConfigError(
        f"precision={precision!r} is not a known precision for strategy='fsdp'",
        hint=did_you_mean(str(precision), FSDP_PRECISIONS, hint=f"choices: {listed}", cutoff=0.5),
    )


def choose_blocks(model: nn.Module, blocks: tuple[type[nn.Module], ...] | None) -> list[nn.Module]:
    """The submodules of ``model`` that become FSDP2 units, children before parents."""
    if blocks is not None:
        chosen: list[nn.Module] = []
        _outermost(model, blocks, chosen)
        if not chosen:
            names = ", ".join(block.__name__ for block in blocks)
            raise ConfigError(
                f"fsdp_blocks=({names},) matches no submodule of {type(model).__name__}",
                hint="name a class the model contains (print(model) lists them), or pass "
                "fsdp_blocks=None for the size rule",
            )
        return chosen
    total = _count(model)
    threshold = max(1, -(-total // _SIZE_SHARE))
    chosen = []
    for child in model.children():
        _by_size(child, threshold, chosen)
    return chosen


def _outermost(
    module: nn.Module, blocks: tuple[type[nn.Module], ...], out: list[nn.Module]
) -> None:
    for child in module.children():
        if isinstance(child, blocks):
            out.append(child)
        else:
            _outermost(child, blocks, out)


def _by_size(module: nn.Module, threshold: int, out: list[nn.Module]) -> int:
    """Parameters of ``module`` not yet in a block; ``module`` joins ``out`` when they reach
    ``threshold``. A module without parameters of its own around one child that has some (a
    ``Block`` around its ``Linear``) is the block instead of that child."""
    children = [child for child in module.children() if _count(child)]
    if len(children) == 1 and not _count(module, recurse=False):
        before = len(out)
        left = _by_size(children[0], threshold, out)
        if len(out) > before and out[-1] is children[0]:
            out[-1] = module
        return left
    left = sum(_by_size(child, threshold, out) for child in children)
    left += _count(module, recurse=False)
    if left >= threshold:
        out.append(module)
        return 0
    return left


def _count(module: nn.Module, *, recurse: bool = True) -> int:
    return sum(parameter.numel() for parameter in module.parameters(recurse=recurse))


def shard_model(
    model: nn.Module,
    blocks: tuple[type[nn.Module], ...] | None,
    policy: MixedPrecisionPolicy,
    compile_options: Mapping[str, Any] | None = None,
) -> nn.Module:
    """``fully_shard`` on every block, then on ``model`` (in place; returns ``model``); with
    ``compile_options``, each block (or ``model`` when there is none) is compiled first."""
    chosen = choose_blocks(model, blocks)
    if compile_options is not None:
        for module in chosen or [model]:
            module.compile(**compile_options)
    for block in chosen:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
