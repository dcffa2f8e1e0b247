"""Apply a validated :class:`~kolossos.shardformer.policies.base_policy.ModelPlan` to a model,
in place: replace layers by their tensor-parallel versions, make head counts local, install the
region / sequence / RNG hooks, mark sequence-parallel parameters, re-tie shared weights and swap
in the vocabulary-parallel loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from kolossos.nn.layer.parallel_1d import (
    Embedding1D,
    FusedLinear1D_Col,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    ensure_tp_rng_states,
    get_tp_spec,
    is_sequence_parallel,
    mark_sequence_parallel,
)
from kolossos.shardformer.fused_region import (
    StagedFusedLinear1D_Col,
    StagedLinear1D_Col,
    fused_region_entry,
    uses_fused_regions,
)
from kolossos.shardformer.hooks import (
    RngFork,
    add_input_hook,
    add_output_hook,
    region_entry,
    sequence_gather,
    sequence_split,
)
from kolossos.shardformer.loss import VocabParallelCausalLMLoss
from kolossos.shardformer.policies.base_policy import BlockPlan, ModelPlan, ParallelLayer
from kolossos.shardformer.shard_config import ShardConfig
from kolossos.shardformer.validate import block_list, resolve_attribute

__all__ = ["SHARDED_ATTR", "ShardedState", "shard_model", "tied_groups"]

SHARDED_ATTR = "_kolossos_shardformer"
"""Attribute set on a sharded model (its :class:`ShardedState`)."""

SharedParams = list[dict[str, nn.Parameter]]


class ShardedState:
    """What the sharder did to a model: its plan, config and hook handles."""

    def __init__(self, plan: ModelPlan, config: ShardConfig) -> None:
        self.plan, self.config = plan, config
        self.handles: list[RemovableHandle] = []


def tied_groups(model: nn.Module, plan: ModelPlan) -> list[list[str]]:
    """The plan's tied groups whose names really share one ``Parameter`` in ``model``."""
    groups = []
    for names in plan.layout.tied:
        params = [model.get_parameter(name) for name in names]
        if all(p is params[0] for p in params):
            groups.append(list(names))
    return groups


def _build_layer(
    layer: ParallelLayer, module: nn.Module, plan: ModelPlan, config: ShardConfig
) -> nn.Module:
    group, sp = config.tp_group, config.sequence_parallel
    vocab = {"make_vocab_size_divisible_by": config.make_vocab_size_divisible_by}
    staged = _fused(config)  # the region entry may compute the column layers' outputs
    if layer.style == "column":  # its region's entry communicates for it
        col = StagedLinear1D_Col if staged else Linear1D_Col
        return col.from_native_module(module, group, input_comm=False)
    if layer.style == "fused_column":
        fused = StagedFusedLinear1D_Col if staged else FusedLinear1D_Col
        return fused.from_native_module(
            module, group, fused_sections=layer.fused_sections, input_comm=False
        )
    if layer.style == "row":
        mode = config.sequence_parallelism_mode if sp else None
        return Linear1D_Row.from_native_module(
            module, group, seq_parallel_mode=mode, seq_dim=layer.seq_dim
        )
    if layer.style == "vocab_embedding":
        return VocabParallelEmbedding1D.from_native_module(module, group, **vocab)
    if layer.style == "embedding":
        return Embedding1D.from_native_module(module, group)
    gather = not (config.parallel_output and plan.causal_lm_loss)
    return VocabParallelLMHead1D.from_native_module(module, group, gather_output=gather, **vocab)


def _replace_layers(
    root: nn.Module, layers: tuple[ParallelLayer, ...], plan: ModelPlan, config: ShardConfig
) -> None:
    for layer in layers:
        parent_path, _, name = layer.path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        new = _build_layer(layer, getattr(parent, name), plan, config)
        setattr(parent, name, new)


def _shard_block(
    block: nn.Module, plan: BlockPlan, model_plan: ModelPlan, state: ShardedState
) -> None:
    config = state.config
    group, sp, tp = config.tp_group, config.sequence_parallel, config.tp_size
    _replace_layers(block, plan.layers, model_plan, config)
    for attr in plan.attributes:
        owner, name = resolve_attribute(block, attr.path)
        setattr(owner, name, attr.full // tp)
    replaced = {layer.path for layer in plan.layers}
    for region in plan.regions:
        module = block.get_submodule(region.path)
        arg = None if region.path in replaced else region.arg  # the layer's own forward(x)
        entry = _region_entry(block, region.path, region.seq_dim, plan, config)
        state.handles.append(add_input_hook(module, arg, entry))
    names = ensure_tp_rng_states(group)
    if sp:
        # Every activation inside a block is a sequence or head shard: all dropout is per-rank.
        state.handles += RngFork(block, names.parallel).handles
        for path in plan.sequence_norms:
            state.handles.append(_mark_sequence_parallel(block.get_submodule(path)))
        return
    for path in plan.parallel_rng:
        fork = RngFork(block.get_submodule(path), names.parallel)
        state.handles += fork.handles
        for inner in plan.replicated_rng:
            if inner.startswith(path + "."):
                state.handles += fork.add_suspension(block.get_submodule(inner))


def _fused(config: ShardConfig) -> bool:
    return uses_fused_regions(
        config.sequence_parallel, config.sequence_parallelism_mode, config.enable_sequence_overlap
    )


def _region_entry(
    block: nn.Module, path: str, seq_dim: int, plan: BlockPlan, config: ShardConfig
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The plain entry, or ('ring' / sequence overlap) one fused with the region's column
    layers (:mod:`kolossos.shardformer.fused_region`)."""
    group, sp = config.tp_group, config.sequence_parallel
    columns = [
        block.get_submodule(layer.path)
        for layer in plan.layers
        if layer.style in ("column", "fused_column")
        and (layer.path == path or layer.path.startswith(path + "."))
    ]
    if not (_fused(config) and columns):
        return region_entry(group, sp, seq_dim)
    return fused_region_entry(group, config.sequence_parallelism_mode, seq_dim, columns)


def _mark_sequence_parallel(module: nn.Module) -> RemovableHandle:
    """Mark ``module``'s parameters sequence-parallel, now and again before every forward:
    ``copy.deepcopy`` and ``load_state_dict(assign=True)`` make new parameters without the
    mark, and the mark must be there when the gradients are summed after backward."""

    def remark(mod: nn.Module, args: tuple[Any, ...]) -> None:
        for param in mod.parameters():
            if not is_sequence_parallel(param):
                mark_sequence_parallel(param)

    remark(module, ())
    return module.register_forward_pre_hook(remark)


def _install_sequence_boundary(model: nn.Module, plan: ModelPlan, state: ShardedState) -> None:
    boundary = plan.sequence
    assert boundary is not None  # validated
    group = state.config.tp_group
    first = block_list(model, plan)[0]
    split = sequence_split(group, boundary.seq_dim)
    state.handles.append(add_input_hook(first, boundary.split_arg, split))
    gather_module = model.get_submodule(boundary.gather_after)
    state.handles.append(add_output_hook(gather_module, sequence_gather(group, boundary.seq_dim)))
    for path in boundary.norms:
        state.handles.append(_mark_sequence_parallel(model.get_submodule(path)))


def _retie(model: nn.Module, groups: list[list[str]]) -> SharedParams:
    """Point every name of each tied group at the group's sharded parameter."""
    shared: SharedParams = []
    for names in groups:
        params = [model.get_parameter(name) for name in names]
        source = next((p for p in params if get_tp_spec(p) is not None), params[0])
        for name, param in zip(names, params, strict=True):
            if param is source:
                continue
            if get_tp_spec(param) is not None and param.shape != source.shape:
                raise ValueError(
                    f"cannot re-tie {name} {tuple(param.shape)} to the sharded "
                    f"{tuple(source.shape)}: the tied layers were split differently."
                )
            owner_path, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_path) if owner_path else model
            setattr(owner, attr, source)
        shared.append(dict.fromkeys(names, source))
    return shared


def shard_model(model: nn.Module, plan: ModelPlan, config: ShardConfig) -> SharedParams:
    """Shard ``model`` in place following ``plan`` (already validated). No communication.

    Returns:
        One ``{name: parameter}`` dict per tied group, all names mapping to the same parameter.
    """
    state = ShardedState(plan, config)
    groups = tied_groups(model, plan)
    _replace_layers(model, plan.layers, plan, config)
    for block in block_list(model, plan):
        _shard_block(block, plan.block, plan, state)
    if config.sequence_parallel:
        _install_sequence_boundary(model, plan, state)
    shared = _retie(model, groups)
    _install_loss(model, plan, config)
    setattr(model, SHARDED_ATTR, state)
    return shared


def _install_loss(model: nn.Module, plan: ModelPlan, config: ShardConfig) -> None:
    if not (plan.causal_lm_loss and config.parallel_output):
        return
    vocab_size: Any = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab_size, int):
        raise ValueError(
            f"the {plan.family!r} plan replaces the causal-LM loss but the model has no "
            "config.vocab_size; set causal_lm_loss=False in the plan to gather the logits."
        )
    # transformers' PreTrainedModel.loss_function has a setter; plain modules get an attribute.
    model.loss_function = VocabParallelCausalLMLoss(config.tp_group, vocab_size)  # type: ignore[assignment]
