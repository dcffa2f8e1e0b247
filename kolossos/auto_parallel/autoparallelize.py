"""``autoparallelize``: trace, search one sharding strategy per operator, apply the plan.

Two paths on a 1-d mesh:

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
  (:mod:`~kolossos.auto_parallel.apply_transformer`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.device_mesh import init_device_mesh

from kolossos.auto_parallel.apply import AutoParallelModule, apply_plan
from kolossos.auto_parallel.apply_transformer import AutoParallelTransformer, apply_family
from kolossos.auto_parallel.module_graph import trace_operators
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
from kolossos.auto_parallel.tracer import ColoTracer, _is_hf_model
from kolossos.auto_parallel.transformer_checkpoint import (
    apply_block_checkpoint,
    search_with_checkpoint,
)
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
    **kwargs: Any,
) -> AutoParallelModule | AutoParallelTransformer:
    """Search a sharding plan for ``model`` and return it parallelised over the mesh.

    Args:
        model: an MLP-like chain of ``nn.Linear``/``nn.LayerNorm``/activations, or a Hugging
            Face GPT-2 or LLaMA (``GPT2LMHeadModel``, ``LlamaForCausalLM``; same initial
            weights on every rank).
        meta_input_samples: ``{"x": tensor}`` of the whole batch's shape (meta tensors work);
            for a transformer the keyword inputs, e.g. ``{"input_ids": ids, "labels": ids,
            "use_cache": False}``.
        device_mesh: a torch ``DeviceMesh``, a kolossos ``DeviceMesh`` (1-d) or ``None`` for
            all ranks of the default group.
        memory_budget: bytes per rank for parameters, gradients, Adam states and activations.
            For a transformer whose every plan family needs more, the model's repeated blocks
            are recomputed in the backward where a Rotor plan says so (the least recompute
            that fits; :mod:`~kolossos.auto_parallel.transformer_checkpoint`).
        cost_model: compute rate and alpha-beta constants; default: the measured matmul rate and
            :class:`CostModel`'s defaults.

    Returns:
        For a transformer an :class:`~kolossos.auto_parallel.apply_transformer.
        AutoParallelTransformer` (the fastest that fits of data parallel, Megatron tensor
        parallel, replicated and data parallel × Megatron on each 2-d layout of the ranks,
        priced on the whole traced DAG); otherwise an
        :class:`~kolossos.auto_parallel.apply.AutoParallelModule`: feed it
        ``local_batch(x)``, compute the loss on its output against ``local_batch(target)``;
        ``print_plan()`` explains the plan.

    Raises:
        UnsupportedOperatorError: (a ``NotImplementedError``) an operator or graph shape outside
            the supported MLP chains; the message names the node and operator.
        InfeasibleBudgetError: no plan fits ``memory_budget`` (for a transformer: even with
            checkpointing; the message gives the smallest reachable peak).
    """
    if kwargs:
        raise TypeError(f"autoparallelize: unsupported options {sorted(kwargs)}.")
    if meta_input_samples is None:
        raise ValueError("autoparallelize needs meta_input_samples, e.g. {'x': meta_tensor}.")
    if not dist.is_initialized():
        raise RuntimeError("autoparallelize needs torch.distributed; call kolossos.launch first.")
    mesh = _torch_mesh(device_mesh)
    cost = cost_model or CostModel(world_size=mesh.size(), flops_per_s=measure_flops_rate())
    if cost.world_size != mesh.size():
        raise ValueError(
            f"cost_model.world_size={cost.world_size} but the mesh has {mesh.size()} ranks."
        )
    if _is_hf_model(model):
        return _autoparallelize_transformer(model, meta_input_samples, mesh, cost, memory_budget)
    chain, targets = build_chain(model, meta_input_samples, cost)
    plan = search_plan(chain, cost, memory_budget)
    return apply_plan(model, plan, mesh, targets)


def _autoparallelize_transformer(
    model: nn.Module,
    meta_input_samples: Mapping[str, Any],
    mesh: TorchDeviceMesh,
    cost: CostModel,
    memory_budget: float | None,
) -> AutoParallelTransformer:
    groups = trace_operators(model, dict(meta_input_samples))
    # dp x tp layouts of the ranks: each traced at its 1/dp of the batch.
    hybrid = {}
    batch = _batch_size(meta_input_samples)
    for dp in range(2, cost.world_size // 2 + 1):
        if cost.world_size % dp == 0 and batch % dp == 0:
            local = {
                k: v.new_empty((v.shape[0] // dp, *v.shape[1:]))
                if isinstance(v, torch.Tensor)
                else v
                for k, v in meta_input_samples.items()
            }
            hybrid[dp] = trace_operators(model, local)
    family, plan, graph_groups, recompute = search_with_checkpoint(
        groups, cost, memory_budget, hybrid
    )
    graph = transformer_graph(graph_groups, cost)
    result = apply_family(model, family, plan, graph, mesh)
    if recompute is not None:
        apply_block_checkpoint(result.module, recompute.recomputed)
        result.recompute = recompute
    return result


def _batch_size(samples: Mapping[str, Any]) -> int:
    sizes = {v.shape[0] for v in samples.values() if isinstance(v, torch.Tensor) and v.dim()}
    if len(sizes) != 1:
        raise ValueError(
            f"meta_input_samples' tensors need one batch size (dimension 0); got {sorted(sizes)}."
        )
    return sizes.pop()


def _torch_mesh(device_mesh: Any) -> TorchDeviceMesh:
    if device_mesh is None:
        return init_device_mesh("cpu", (dist.get_world_size(),))
    is_torch = isinstance(device_mesh, TorchDeviceMesh)
    mesh = device_mesh if is_torch else device_mesh.get_torch_mesh()
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"autoparallelize supports 1-d meshes; got shape {tuple(mesh.shape)}."
        )
    return mesh
