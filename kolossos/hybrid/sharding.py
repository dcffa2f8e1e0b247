"""Applying the tensor-parallel plan to the user's model, and re-pointing their optimizer.

The plan is ShardFormer's (:mod:`kolossos.shardformer`): it replaces the model's layers in place
by tensor-parallel ones holding this rank's shards. The user built the optimizer over the
original parameters, so afterwards every optimizer entry is swapped, by parameter name, for the
sharded parameter now living under that name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.hybrid.config import HybridParallelConfig
from kolossos.hybrid.sequence_parallel import ATTENTION_MODES, install_sequence_parallel
from kolossos.shardformer import ShardConfig, ShardFormer
from kolossos.shardformer.optimizations import align_plan_heads
from kolossos.shardformer.shardformer import _resolve_plan as resolve_plan

__all__ = ["check_shard_options", "needs_sharding", "repoint_optimizer", "shard_model"]

#: plugin options forwarded to ShardConfig when it has a field of that name
_OPTIONAL = (
    "enable_fused_normalization",
    "enable_flash_attention",
    "enable_jit_fused",
    "enable_sequence_overlap",
    "parallel_output",
    "make_vocab_size_divisible_by",
    "gradient_checkpoint_config",
)


def needs_sharding(config: HybridParallelConfig) -> bool:
    """Whether ShardFormer has anything to do (TP, SP, a custom plan or an optimisation)."""
    flags = ("enable_all_optimization", "enable_sequence_parallelism", *_OPTIONAL[:4])
    return (
        config.tp_size > 1
        or config.custom_policy is not None
        or config.gradient_checkpoint_config is not None
        or any(getattr(config, name) for name in flags)
    )


def _shard_config(config: HybridParallelConfig, tp_group: dist.ProcessGroup | None) -> ShardConfig:
    """The ``ShardConfig`` for ``config``: the plugin options ShardConfig has are forwarded."""
    fields = {f.name for f in dataclasses.fields(ShardConfig)}
    defaults = {f.name: f.default for f in dataclasses.fields(HybridParallelConfig)}
    for name in _OPTIONAL:
        if name not in fields and getattr(config, name) != defaults[name]:
            raise NotImplementedError(
                f"{name}={getattr(config, name)!r} is not supported by kolossos.shardformer "
                f"yet; leave it at its default ({defaults[name]!r})."
            )
    attention_sp = config.sequence_parallelism_mode in ATTENTION_MODES
    kwargs: dict[str, Any] = {
        "tensor_parallel_process_group": tp_group,
        "enable_tensor_parallelism": config.tp_size > 1,
        # Megatron SP only: the attention-level modes are installed after (sequence_parallel.py)
        "enable_sequence_parallelism": config.enable_sequence_parallelism and not attention_sp,
        "sequence_parallelism_mode": config.sequence_parallelism_mode or "split_gather",
        "enable_all_optimization": config.enable_all_optimization,
    }
    kwargs.update({name: getattr(config, name) for name in _OPTIONAL if name in fields})
    if config.pp_size > 1:  # checkpointed per stage after the split (hybrid/checkpointing.py)
        kwargs["gradient_checkpoint_config"] = None
    return ShardConfig(**kwargs)


def check_shard_options(config: HybridParallelConfig) -> None:
    """Build the ShardConfig once without a group, so options ShardFormer cannot honour fail
    before any collective.

    Raises:
        NotImplementedError: an option set away from its default that ShardFormer lacks.
        ValueError / TypeError: ShardConfig's own validation.
    """
    if needs_sharding(config):
        _shard_config(config, None)


def shard_model(
    model: nn.Module,
    config: HybridParallelConfig,
    tp_group: dist.ProcessGroup,
    sp_group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Apply the plan (``config.custom_policy`` or the automatic one) to ``model`` in place;
    ``sp_group``: the sequence-parallel group of ``'all_to_all'`` / ``'ring_attn'``.

    Returns:
        The sharded model (``model`` itself when there is nothing to shard).
    """
    if not needs_sharding(config):
        _align_head(model, config.make_vocab_size_divisible_by)
        return model
    shard_config = _shard_config(config, tp_group)
    if config.sp_axis_size > 1:  # (with sp_size 1 the attention modes change nothing)
        plan = resolve_plan(model, config.custom_policy)  # before sharding: names still hold
        sharded, _shared = ShardFormer(shard_config).optimize(model, policy=plan)
        vocab_group = (
            tp_group
            if config.tp_size > 1 and config.parallel_output and plan.causal_lm_loss
            else None
        )
        mode = config.sequence_parallelism_mode
        assert sp_group is not None and mode is not None
        install_sequence_parallel(
            sharded, plan, sp_group, mode, vocab_group, config.tp_size, config.pp_size > 1
        )
        return sharded
    sharded, _shared = ShardFormer(shard_config).optimize(model, policy=config.custom_policy)
    return sharded


def _align_head(model: nn.Module, multiple: int) -> None:
    """tp 1 with nothing for ShardFormer to do: still run the LM head's CUDA products over the
    aligned vocabulary, as ShardFormer does at tp 1 (``AlignedLMHead``); a model without a
    built-in plan is left as it is."""
    try:
        plan = resolve_plan(model, None)
    except ValueError:
        return
    align_plan_heads(model, plan, multiple)


def first_names(model: nn.Module) -> dict[torch.Tensor, str]:
    """``{parameter: its first name}`` (a tied parameter under its first name)."""
    names: dict[torch.Tensor, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, name)
    return names


def check_fresh(optimizer: Optimizer, names: dict[torch.Tensor, str]) -> None:
    """Refuse optimizers that cannot be re-pointed at the sharded parameters.

    Raises:
        ValueError: the optimizer has state already, or holds a tensor outside the model.
    """
    if any(optimizer.state.values()):
        raise ValueError(
            "the optimizer already has state (it has stepped); HybridParallelPlugin shards the "
            "model's parameters, so boost the model and a fresh optimizer before training."
        )
    for g, group in enumerate(optimizer.param_groups):
        for j, param in enumerate(group["params"]):
            if param not in names:
                raise ValueError(
                    f"optimizer param_groups[{g}].params[{j}] is not a parameter of the model; "
                    "build the optimizer over model.parameters() before booster.boost."
                )


def repoint_optimizer(
    optimizer: Optimizer,
    names: dict[torch.Tensor, str],
    sharded: nn.Module,
    keep: nn.Module | None = None,
) -> None:
    """Swap each optimizer entry for the parameter living under its name in ``sharded``; with
    ``keep`` (a rank's pipeline stage chunks), drop the entries ``keep`` does not hold."""
    current = dict(sharded.named_parameters(remove_duplicate=False))
    local = None if keep is None else set(keep.parameters())
    for group in optimizer.param_groups:
        params = [current[names[p]] for p in group["params"]]
        group["params"] = params if local is None else [p for p in params if p in local]
