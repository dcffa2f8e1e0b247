"""``autoparallelize``: trace, search one sharding strategy per operator, apply the plan.

Three paths on a 1-d mesh:

* chains of ``nn.Linear``, ``nn.LayerNorm`` and elementwise activations (MLPs): the chain
  dynamic program compares the best pure data-parallel and the best pure tensor-parallel
  (Megatron column/row) plan under the memory budget — the two families
  :func:`~kolossos.auto_parallel.apply.apply_plan` implements;
* Hugging Face transformers (GPT-2, LLaMA): the ATen graph is grouped into operators
  (:mod:`~kolossos.auto_parallel.module_graph`), priced per strategy
  (:mod:`~kolossos.auto_parallel.transformer_strategies`) and searched with the ILP
  (:mod:`~kolossos.auto_parallel.ilp`); the fastest executable family that fits — data
  parallel, Megatron tensor parallel, replicated, data parallel × Megatron on a 2-d layout
  of the ranks — is applied
  (:mod:`~kolossos.auto_parallel.apply_transformer`); on a user's 2-d ``(D, T)`` mesh only its
  own layout (:mod:`~kolossos.auto_parallel.auto_mesh`). On a 1-d mesh, when the ILP's
  unrestricted per-operator optimum (mixing data parallelism, Megatron and replication
  operator by operator) is predicted faster than every family by :data:`MIXED_GAIN`, it runs
  instead, through the graph executor (:mod:`~kolossos.auto_parallel.apply_graph`);
* other models that are not MLP chains but group into operators (a ResNet): the fastest of
  data parallelism (synchronised BatchNorm statistics) and replication, or the ILP's
  per-operator plan when it is faster by :data:`MIXED_GAIN` — all through the graph executor.

Costs measured here (``cost_model=None``) include how much slower the ranks compute side by
side (:func:`~kolossos.auto_parallel.calibrate.calibrate_contention`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kolossos.accelerator import get_accelerator
from kolossos.auto_parallel.apply import AutoParallelModule, apply_plan
from kolossos.auto_parallel.apply_graph import AutoParallelGraph, apply_graph_plan
from kolossos.auto_parallel.apply_transformer import AutoParallelTransformer, apply_family
from kolossos.auto_parallel.auto_mesh import (
    AutoMesh,
    check_mesh,
    check_transformer_sizes,
    hybrid_sizes,
    resolve_mesh,
)
from kolossos.auto_parallel.calibrate import (
    calibrate_contention,
    check_contention,
    contended,
    slowest,
)
from kolossos.auto_parallel.module_graph import OperatorGroup, trace_operators
from kolossos.auto_parallel.sharding_graph import DagPlan
from kolossos.auto_parallel.solver import (
    DATA_PARALLEL,
    TENSOR_PARALLEL,
    ChainNode,
    InfeasibleBudgetError,
    Plan,
    solve_chain,
)
from kolossos.auto_parallel.strategies import (
    CostModel,
    UnsupportedOperatorError,
    classify,
    param_sizes,
    strategies_for,
)
from kolossos.auto_parallel.traced_graph import TracingError
from kolossos.auto_parallel.tracer import ColoTracer, _is_hf_model
from kolossos.auto_parallel.transformer_checkpoint import (
    apply_block_checkpoint,
    search_with_checkpoint,
)
from kolossos.auto_parallel.transformer_plan import family_plan, search_free
from kolossos.auto_parallel.transformer_strategies import transformer_graph

__all__ = ["autoparallelize", "build_chain", "measure_flops_rate", "search_plan"]


def measure_flops_rate(size: int = 256, repeats: int = 5) -> float:
    """Matmul FLOPs per second of this process (median of ``repeats`` ``size``-cubed products)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2.0 * size**3 / sorted(times)[len(times) // 2]


def build_chain(
    model: nn.Module, meta_input_samples: Mapping[str, torch.Tensor], cost: CostModel
) -> tuple[list[ChainNode], dict[str, str]]:
    """Trace ``model`` and return its operator chain with strategies, and node -> module path.

    Raises:
        UnsupportedOperatorError: an operator without strategies, or a graph that is not a chain.
    """
    traced = ColoTracer(backend="fx").trace(model, dict(meta_input_samples))
    graph = traced.graph_module
    infos = {i.name: i for i in traced.nodes}
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise UnsupportedOperatorError(
            f"autoparallelize supports one input tensor; the graph has {len(placeholders)} "
            f"({[n.name for n in placeholders]})."
        )
    chain: list[ChainNode] = []
    targets: dict[str, str] = {}
    previous = placeholders[0]
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        kind = classify(node, graph)
        inputs = node.all_input_nodes
        if inputs != [previous]:
            raise UnsupportedOperatorError(
                f"node {node.name!r} (operator {node.target}) takes {[n.name for n in inputs]}, "
                f"not only the previous node {previous.name!r}: autoparallelize supports chains."
            )
        module = graph.get_submodule(str(node.target)) if node.op == "call_module" else None
        params, bias = param_sizes(module) if module is not None else (0.0, 0.0)
        in_bytes = float(infos[previous.name].output_bytes)
        chain.append(
            ChainNode(
                name=node.name,
                in_bytes=in_bytes,
                out_bytes=float(infos[node.name].output_bytes),
                strategies=strategies_for(
                    kind,
                    flops=float(infos[node.name].flops),
                    param_bytes=params,
                    bias_bytes=bias,
                    out_bytes=float(infos[node.name].output_bytes),
                    in_bytes=in_bytes,
                    cost=cost,
                ),
            )
        )
        targets[node.name] = str(node.target)
        previous = node
    if not chain:
        raise UnsupportedOperatorError("the traced graph has no operators.")
    return chain, targets


def search_plan(
    chain: list[ChainNode], cost: CostModel, memory_budget: float | None = None
) -> Plan:
    """The faster of the best data-parallel and best tensor-parallel plan within the budget.

    Raises:
        InfeasibleBudgetError: neither family fits.
    """
    plans = []
    for layouts in (DATA_PARALLEL, TENSOR_PARALLEL):
        try:
            plans.append(
                solve_chain(
                    chain,
                    cost,
                    memory_budget=memory_budget,
                    allowed_layouts=layouts,
                    input_layouts=layouts[:1],
                )
            )
        except InfeasibleBudgetError as exc:
            error = exc
    if not plans:
        raise error
    return min(plans, key=lambda p: p.step_time)


def autoparallelize(
    model: nn.Module,
    meta_input_samples: Mapping[str, torch.Tensor] | None = None,
    device_mesh: Any = None,
    memory_budget: float | None = None,
    *,
    cost_model: CostModel | None = None,
    contention: float | None = None,
    **kwargs: Any,
) -> AutoParallelModule | AutoParallelTransformer | AutoParallelGraph:
    """Search a sharding plan for ``model`` and return it parallelised over the mesh.

    Args:
        model: an MLP-like chain of ``nn.Linear``/``nn.LayerNorm``/activations, a Hugging
            Face GPT-2, LLaMA or ViT (``GPT2LMHeadModel``, ``LlamaForCausalLM``,
            ``ViTForImageClassification``), or another model of the operators
            :mod:`~kolossos.auto_parallel.module_graph` groups whose forward returns its loss
            (a ResNet with BatchNorms); same initial weights on every rank.
        meta_input_samples: ``{"x": tensor}`` of the whole batch's shape (meta tensors work);
            for a transformer the keyword inputs, e.g. ``{"input_ids": ids, "labels": ids,
            "use_cache": False}``.
        device_mesh: a torch ``DeviceMesh`` or a kolossos ``DeviceMesh`` of every rank, or
            ``None`` for all ranks of the default group (1-d). A 2-d mesh ``(D, T)`` is data
            parallel × tensor parallel (dim 0 and dim 1, or ``mesh_dim_names`` ``("dp",
            "tp")``); a transformer's families on it are ``dp``, ``megatron`` and
            ``replicated`` over all ranks and ``dp{D}xtp{T}`` on its axes
            (:mod:`~kolossos.auto_parallel.auto_mesh`); MLP chains need a 1-d mesh.
        memory_budget: bytes per rank for parameters, gradients, Adam states and activations.
            For a transformer whose every plan family needs more, the model's repeated blocks
            are recomputed in the backward where a Rotor plan says so (the least recompute
            that fits; :mod:`~kolossos.auto_parallel.transformer_checkpoint`).
        cost_model: compute rate and alpha-beta constants; default: the matmul rate measured
            on every rank (the slowest), :class:`CostModel`'s defaults otherwise.
        contention: how much slower the ranks compute side by side than alone (>= 1); every
            compute constant of the cost model is slowed by it, communication is not
            (:func:`~kolossos.auto_parallel.calibrate.contended`). ``None``: measured in about
            1 s (:func:`~kolossos.auto_parallel.calibrate.calibrate_contention`) when
            ``cost_model`` is ``None`` and the accelerator is the CPU, else 1.

    Returns:
        For a transformer an :class:`~kolossos.auto_parallel.apply_transformer.
        AutoParallelTransformer` (the fastest that fits of data parallel, Megatron tensor
        parallel, replicated and data parallel × Megatron on each 2-d layout of the ranks,
        priced on the whole traced DAG), or an :class:`~kolossos.auto_parallel.apply_graph.
        AutoParallelGraph` running the ILP's per-operator plan when that is faster (for a
        non-chain model outside ``transformers`` always an ``AutoParallelGraph``: family
        ``dp``, ``replicated`` or ``mixed``); for an MLP chain an
        :class:`~kolossos.auto_parallel.apply.AutoParallelModule`: feed it
        ``local_batch(x)``, compute the loss on its output against ``local_batch(target)``;
        ``print_plan()`` explains the plan.

    Raises:
        UnsupportedOperatorError: (a ``NotImplementedError``) an operator or graph shape outside
            the supported MLP chains; the message names the node and operator.
        NotImplementedError: a mesh of more than 2 dimensions, or an MLP chain on a 2-d mesh.
        ValueError: a mesh not of every rank, 2-d dim names other than ``("dp", "tp")``, a
            batch not divisible by ``D`` or attention heads not by ``T`` (before any
            collective), a ``cost_model`` of another size or a ``contention`` below 1.
        InfeasibleBudgetError: no plan fits ``memory_budget`` (for a transformer: even with
            checkpointing; the message gives the smallest reachable peak).
    """
    if kwargs:
        raise TypeError(f"autoparallelize: unsupported options {sorted(kwargs)}.")
    if meta_input_samples is None:
        raise ValueError("autoparallelize needs meta_input_samples, e.g. {'x': meta_tensor}.")
    if not dist.is_initialized():
        raise RuntimeError("autoparallelize needs torch.distributed; call kolossos.launch first.")
    world = dist.get_world_size()
    dp_tp = check_mesh(device_mesh, world)  # every check before the first collective
    is_transformer = _is_hf_model(model)
    if dp_tp is not None and not is_transformer:
        raise NotImplementedError(
            f"autoparallelize searches MLP chains on a 1-d mesh only, as other models outside "
            f"transformers (their solvers and executors shard one axis); got a {dp_tp[0]} x "
            f"{dp_tp[1]} mesh. Pass a 1-d mesh of the {world} ranks or device_mesh=None."
        )
    if dp_tp is not None:
        check_transformer_sizes(model, dp_tp, _batch_size(meta_input_samples))
    if cost_model is not None and cost_model.world_size != world:
        raise ValueError(
            f"cost_model.world_size={cost_model.world_size} but the mesh has {world} ranks."
        )
    if contention is not None:
        check_contention(contention)
    meshes = resolve_mesh(device_mesh)
    cost = cost_model or CostModel(
        world_size=world, flops_per_s=1.0 / slowest(1.0 / measure_flops_rate())
    )
    if contention is None and cost_model is None and get_accelerator().name == "cpu":
        contention = calibrate_contention(*_probe_shape(model, meta_input_samples, world))
    cost = contended(cost, contention or 1.0)
    if is_transformer:
        return _autoparallelize_transformer(
            model, meta_input_samples, meshes, cost, memory_budget, dp_tp
        )
    try:
        chain, targets = build_chain(model, meta_input_samples, cost)
    except UnsupportedOperatorError as chain_error:
        try:
            groups = trace_operators(model, dict(meta_input_samples))
        except (UnsupportedOperatorError, TracingError) as graph_error:
            raise UnsupportedOperatorError(
                f"{chain_error} It is not an operator graph autoparallelize runs either: "
                f"{graph_error}"
            ) from graph_error
        return _autoparallelize_graph(model, meta_input_samples, groups, meshes, cost,
                                      memory_budget)  # fmt: skip
    plan = search_plan(chain, cost, memory_budget)
    return apply_plan(model, plan, meshes.flat, targets)


def _autoparallelize_transformer(
    model: nn.Module,
    meta_input_samples: Mapping[str, Any],
    meshes: AutoMesh,
    cost: CostModel,
    memory_budget: float | None,
    dp_tp: tuple[int, int] | None,
) -> AutoParallelTransformer | AutoParallelGraph:
    groups = trace_operators(model, dict(meta_input_samples))
    # dp x tp layouts of the ranks (on a 2-d mesh its own): each traced at 1/dp of the batch.
    hybrid = {}
    batch = _batch_size(meta_input_samples)
    for dp in hybrid_sizes(dp_tp, cost.world_size, batch):
        local = {
            k: v.new_empty((v.shape[0] // dp, *v.shape[1:])) if isinstance(v, torch.Tensor) else v
            for k, v in meta_input_samples.items()
        }
        hybrid[dp] = trace_operators(model, local)
    family, plan, graph_groups, recompute = search_with_checkpoint(
        groups, cost, memory_budget, hybrid
    )
    graph = transformer_graph(graph_groups, cost)
    if recompute is None and dp_tp is None:
        mixed = _mixed_plan(model, meta_input_samples, groups, plan, cost, memory_budget, meshes)
        if mixed is not None:
            return mixed
    result = apply_family(model, family, plan, graph, meshes.flat, grid=meshes.grid)
    if recompute is not None:
        apply_block_checkpoint(result.module, recompute.recomputed)
        result.recompute = recompute
    return result


GRAPH_FAMILIES = ("dp", "replicated")
"""The families of a model outside ``transformers`` that is not an MLP chain (a CNN): data
parallelism (with synchronised BatchNorm statistics) and replication; its tensor-parallel
option is the ILP's per-operator plan (Megatron's roles have no meaning there). All run
through the graph executor."""


def _autoparallelize_graph(
    model: nn.Module,
    samples: Mapping[str, Any],
    groups: list[OperatorGroup],
    meshes: AutoMesh,
    cost: CostModel,
    memory_budget: float | None,
) -> AutoParallelGraph:
    """A non-chain model outside ``transformers`` (a ResNet): the fastest of
    :data:`GRAPH_FAMILIES` that fits the budget, or the ILP's per-operator plan when it is
    predicted faster by :data:`MIXED_GAIN` (or is the only one that fits), all run by the
    graph executor; no activation checkpointing.

    Raises:
        InfeasibleBudgetError: no plan fits (the message lists each family's memory).
        UnsupportedOperatorError: the executor cannot run the plan (names the node).
    """
    budget = float("inf") if memory_budget is None else memory_budget
    plans = {f: family_plan(f, groups, cost) for f in GRAPH_FAMILIES}
    fitting = {f: p for f, p in plans.items() if p.memory <= budget}
    try:
        free: DagPlan | None = search_free(groups, cost, memory_budget)
    except InfeasibleBudgetError:
        free = None
    if free is None and not fitting:
        sizes = ", ".join(f"{f} {p.memory:.0f}" for f, p in plans.items())
        raise InfeasibleBudgetError(
            f"no plan fits the memory budget of {budget:.0f} bytes per rank on "
            f"{cost.world_size} ranks (bytes per rank: {sizes}; the per-operator search found "
            "none either). Raise memory_budget or use more ranks."
        )
    family = min(fitting, key=lambda f: (fitting[f].step_time, fitting[f].memory), default="")
    if free is not None and (
        not family or free.step_time < fitting[family].step_time * (1.0 - MIXED_GAIN)
    ):
        family, plan = "mixed", free
    else:
        plan = fitting[family]
    graph = transformer_graph(groups, cost)
    result = apply_graph_plan(model, samples, groups, plan, graph, meshes.flat)
    result.family = family
    return result


MIXED_GAIN = 0.01
"""How much faster (relative) the ILP's per-operator plan must be predicted than the best
family for :func:`autoparallelize` to run it through the graph executor."""


def _mixed_plan(
    model: nn.Module,
    samples: Mapping[str, Any],
    groups: list[OperatorGroup],
    family_best: DagPlan,
    cost: CostModel,
    memory_budget: float | None,
    meshes: AutoMesh,
) -> AutoParallelGraph | None:
    """The ILP's per-operator optimum run by the graph executor, when it is predicted faster
    than the best family by :data:`MIXED_GAIN` and the executor can run it; else ``None``."""
    try:
        free = search_free(groups, cost, memory_budget)
    except InfeasibleBudgetError:
        return None
    if free.step_time >= family_best.step_time * (1.0 - MIXED_GAIN):
        return None
    try:
        return apply_graph_plan(
            model, samples, groups, free, transformer_graph(groups, cost), meshes.flat
        )
    except UnsupportedOperatorError:  # the same on every rank: they share rank 0's plan
        return None


def _batch_size(samples: Mapping[str, Any]) -> int:
    sizes = {v.shape[0] for v in samples.values() if isinstance(v, torch.Tensor) and v.dim()}
    if len(sizes) != 1:
        raise ValueError(
            f"meta_input_samples' tensors need one batch size (dimension 0); got {sorted(sizes)}."
        )
    return sizes.pop()


def _probe_shape(model: nn.Module, samples: Mapping[str, Any], world: int) -> tuple[int, int]:
    """(rows per rank, features) of the contention probe: a float input's last dimension, or
    for token ids the model's ``hidden_size``."""
    first = next(v for v in samples.values() if isinstance(v, torch.Tensor))
    if first.is_floating_point() and first.dim():
        hidden = int(first.shape[-1])
        rows = first.numel() // max(hidden, 1)
    else:
        hidden = int(getattr(getattr(model, "config", None), "hidden_size", 64))
        rows = first.numel()
    return max(1, rows // world), hidden
