"""Check a :class:`~kolossos.shardformer.policies.base_policy.ModelPlan` against a model before
anything is sharded: every path exists and has the right kind of module, every split size is
divisible by the tensor-parallel size, every column layer lies in a tensor-parallel region, and
(under sequence parallelism) every block parameter is accounted for. No communication."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from kolossos.nn.layer.parallel_1d import is_conv1d
from kolossos.shardformer.policies.base_policy import BlockPlan, ModelPlan, ParallelLayer

__all__ = ["block_list", "resolve_attribute", "validate_plan"]

_LINEAR_STYLES = ("column", "fused_column", "row", "lm_head")


def _fail(plan: ModelPlan, problems: list[str]) -> None:
    if problems:
        listing = "\n  - ".join(problems)
        raise ValueError(
            f"the {plan.family!r} tensor-parallel plan does not fit this model:\n  - {listing}"
        )


def _module(root: nn.Module, path: str, where: str, problems: list[str]) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        problems.append(f"{where}: no sub-module {path!r}")
        return None


def block_list(model: nn.Module, plan: ModelPlan) -> nn.ModuleList:
    """The plan's block list in ``model``.

    Raises:
        ValueError: the path is missing or not a non-empty ``nn.ModuleList``.
    """
    path = plan.layout.blocks
    try:
        blocks = model.get_submodule(path)
    except AttributeError:
        blocks = None
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(
            f"the {plan.family!r} plan expects a non-empty nn.ModuleList of blocks at {path!r}; "
            f"{type(model).__name__} has {type(blocks).__name__} there."
        )
    return blocks


def resolve_attribute(root: nn.Module, path: str) -> tuple[object, str]:
    """``(owner, name)`` of the dotted attribute ``path`` below ``root``."""
    owner_path, _, name = path.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    return owner, name


def _layer_size_problem(layer: ParallelLayer, module: nn.Module, tp: int) -> str | None:
    """Why ``module`` cannot become ``layer`` over ``tp`` ranks, or ``None``."""
    where = f"{layer.path} ({layer.style})"
    if layer.style in _LINEAR_STYLES:
        conv1d = is_conv1d(module) and layer.style != "lm_head"
        if not isinstance(module, nn.Linear) and not conv1d:
            return f"{where} is a {type(module).__name__}, expected nn.Linear or Conv1D"
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        in_f, out_f = weight.shape if conv1d else weight.shape[::-1]  # Conv1D stores (in, out)
        if layer.style == "column" and out_f % tp:
            return f"{where}: out_features={out_f} is not divisible by tp_size={tp}"
        if layer.style == "row" and in_f % tp:
            return f"{where}: in_features={in_f} is not divisible by tp_size={tp}"
        if layer.style == "fused_column":
            sections = layer.fused_sections or ()
            if sum(sections) != out_f or any(s % tp for s in sections):
                return (
                    f"{where}: fused_sections={sections} must sum to out_features={out_f} and "
                    f"each be divisible by tp_size={tp}"
                )
        return None
    if not isinstance(module, nn.Embedding):
        return f"{where} is a {type(module).__name__}, expected nn.Embedding"
    if layer.style == "embedding" and module.embedding_dim % tp:
        return f"{where}: embedding_dim={module.embedding_dim} is not divisible by tp_size={tp}"
    return None


def _check_layers(
    root: nn.Module, layers: tuple[ParallelLayer, ...], tp: int, where: str, problems: list[str]
) -> None:
    for layer in layers:
        module = _module(root, layer.path, where, problems)
        if module is not None:
            problem = _layer_size_problem(layer, module, tp)
            if problem is not None:
                problems.append(f"{where}: {problem}")


def _forward_takes(module: nn.Module, arg: str) -> bool:
    """Whether ``module.forward`` takes ``arg`` as its first parameter or by name."""
    params = list(inspect.signature(module.forward).parameters)
    return bool(params) and (params[0] == arg or arg in params)


def _check_block(block: nn.Module, plan: BlockPlan, tp: int, sp: bool, problems: list[str]) -> None:
    where = "block"
    _check_layers(block, plan.layers, tp, where, problems)
    for region in plan.regions:
        module = _module(block, region.path, where, problems)
        if module is not None and not _forward_takes(module, region.arg):
            problems.append(
                f"block: region {region.path!r}: forward has no {region.arg!r} argument"
            )
    for layer in plan.layers:
        inside = any(
            layer.path == r.path or layer.path.startswith(r.path + ".") for r in plan.regions
        )
        if layer.style in ("column", "fused_column") and not inside:
            problems.append(
                f"block: column layer {layer.path!r} lies in no TPRegion; add "
                f"TPRegion(path=...) for the module that receives its input"
            )
    for attr in plan.attributes:
        try:
            owner, name = resolve_attribute(block, attr.path)
            value = getattr(owner, name)
        except AttributeError:
            problems.append(f"block: no attribute {attr.path!r}")
            continue
        if value != attr.full:
            problems.append(f"block: {attr.path}={value!r}, the plan expects {attr.full}")
        elif attr.full % tp:
            problems.append(f"block: {attr.path}={attr.full} is not divisible by tp_size={tp}")
    for path in plan.replicated_rng:
        if not any(path.startswith(outer + ".") for outer in plan.parallel_rng):
            problems.append(f"block: replicated_rng {path!r} lies in no parallel_rng module")
    for path in (
        *plan.sequence_norms,
        *plan.parallel_rng,
        *plan.replicated_rng,
        *plan.replicated_params,
    ):
        _module(block, path, where, problems)
    if sp:
        _check_coverage(block, plan, problems)


def _check_coverage(block: nn.Module, plan: BlockPlan, problems: list[str]) -> None:
    """Under sequence parallelism every block parameter must be sharded or declared."""
    owners = [layer.path for layer in plan.layers]
    owners += [*plan.sequence_norms, *plan.replicated_params]
    for name, _ in block.named_parameters():
        if not any(name.startswith(owner + ".") for owner in owners):
            problems.append(
                f"block: parameter {name!r} is neither sharded nor declared; under sequence "
                "parallelism list its module in sequence_norms (it runs on sequence shards) or "
                "replicated_params (it sees gathered activations)"
            )


def _check_divisible(plan: ModelPlan, tp: int, problems: list[str]) -> None:
    for item in plan.divisible:
        if item.value % tp:
            problems.append(
                f"{item.name}={item.value} is not divisible by tp_size={tp}; choose a "
                f"tensor-parallel size that divides it"
            )


def validate_plan(model: nn.Module, plan: ModelPlan, tp: int, sequence_parallel: bool) -> None:
    """Raise ``ValueError`` listing every way ``plan`` does not fit ``model`` on ``tp`` ranks.

    Raises:
        ValueError: a size is not divisible, a path is missing or of the wrong kind, a column
            layer lies in no region, or sequence parallelism is requested but unsupported.
    """
    problems: list[str] = []
    _check_divisible(plan, tp, problems)
    if sequence_parallel and plan.sequence is None:
        reasons = "; ".join(plan.notes) or "the plan declares no SequenceBoundary"
        problems.append(f"sequence parallelism is not supported by this plan ({reasons})")
    _check_layers(model, plan.layers, tp, "model", problems)
    for layer in plan.layers:
        if layer.style in ("column", "fused_column", "row"):
            problems.append(
                f"model: {layer.path!r} has style {layer.style!r}; model-level layers may only "
                "be embeddings or lm_head (put column/row layers in the BlockPlan)"
            )
    blocks = block_list(model, plan)
    for block in blocks:
        _check_block(block, plan.block, tp, sequence_parallel, problems)
        if problems:
            break  # blocks are alike: report the first block's problems only
    if sequence_parallel and plan.sequence is not None:
        for path in (plan.sequence.gather_after, *plan.sequence.norms):
            _module(model, path, "sequence", problems)
        if not _forward_takes(blocks[0], plan.sequence.split_arg):
            problems.append(f"sequence: the first block takes no {plan.sequence.split_arg!r}")
    for group in plan.layout.tied:
        for name in group:
            try:
                model.get_parameter(name)
            except AttributeError:
                problems.append(f"tied: no parameter {name!r}")
    _fail(plan, problems)
