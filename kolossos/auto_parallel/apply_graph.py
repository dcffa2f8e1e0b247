"""Run any per-operator plan of the ILP (on GPT-2, LLaMA, ViT, a ResNet): the traced ATen
graph, rewritten for this rank.

:func:`~kolossos.auto_parallel.transformer_plan.search_free` picks one strategy per operator
and may mix data parallelism, Megatron tensor parallelism and replication operator by
operator. :func:`apply_graph_plan` makes such a plan runnable:

1. the model is exported (``torch.export``, the graph the planner priced) and its nodes are
   grouped into the same operators (:func:`~kolossos.auto_parallel.module_graph.
   build_module_graph`);
2. each node runs in its operator's layout: ``B`` on this rank's batch rows, ``F`` on its
   features / heads / vocabulary columns, ``R`` whole; which dimension that is comes from
   :mod:`~kolossos.auto_parallel.shard_dims`, and the sizes written in ``view``/``reshape``/
   ``expand``/``split`` arguments are divided on it;
3. every edge whose layouts differ gets a conversion (:func:`~kolossos.auto_parallel.
   graph_comm.relayout`: all-gather, slice, or the identity with an all-reduce in backward);
4. parameters are stored as their strategies need: column-parallel weights (``col``) by
   output features — GPT-2's fused ``c_attn`` per head of q, k and v — row-parallel
   (``row``) by input features with the partial products summed, a vocabulary-parallel
   embedding (``vocab``) by rows, a column-parallel convolution by output channels, a
   channel-sharded BatchNorm (``F``) by channel with its running statistics
   (:mod:`~kolossos.auto_parallel.graph_params`); every other parameter whole. Whole
   parameters used by a batch-sharded operator (``dp``, layout ``B``) get their gradients
   summed over the mesh at the end of backward in one flat all-reduce; a tied weight used
   under different strategies is stored whole and each use takes its part;
5. the loss keeps the whole batch's mean: under ``B`` each rank's sum over its rows divided by
   the count of counted targets over all ranks (then summed), under ``F`` the
   vocabulary-parallel cross entropy;
6. a batch-sharded BatchNorm in training normalises with the whole batch's statistics
   (:func:`~kolossos.auto_parallel.graph_comm.sync_batch_norm`); buffer mutations that
   ``torch.export`` returns as graph outputs are written back into the buffers.

The returned module takes the whole batch (the same on every rank) and returns the model's
output: the loss is the whole batch's, ``logits`` this rank's part in the lm head's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.utils._pytree import tree_unflatten

from kolossos.auto_parallel import graph_comm
from kolossos.auto_parallel.grad_sync import reduce_gradients_after_backward
from kolossos.auto_parallel.graph_params import ParamSpec
from kolossos.auto_parallel.graph_rewrite import GraphRewriter
from kolossos.auto_parallel.module_graph import OperatorGroup, build_module_graph
from kolossos.auto_parallel.sharding_graph import DagPlan, ShardingGraph
from kolossos.auto_parallel.strategies import UnsupportedOperatorError
from kolossos.auto_parallel.traced_graph import TracedGraph, node_info
from kolossos.auto_parallel.transformer_plan import format_dag_plan

__all__ = ["AutoParallelGraph", "apply_graph_plan", "export_model"]


def export_model(
    model: nn.Module, samples: Mapping[str, Any]
) -> tuple[torch.export.ExportedProgram, TracedGraph]:
    """``torch.export`` of ``model`` on fake copies of ``samples`` and its traced graph."""
    from torch._subclasses import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = {}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for key, value in samples.items():
        if isinstance(value, torch.Tensor):
            with mode:  # on the model's device (meta samples carry only shape and dtype)
                fake[key] = torch.empty(value.shape, dtype=value.dtype, device=device)
        else:
            fake[key] = value
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    try:
        program = torch.export.export(model, (), kwargs=fake, strict=False)
    finally:
        with torch.no_grad():
            for name, buf in model.named_buffers():
                buf.copy_(buffers[name])
    gm = program.graph_module
    infos = [node_info(node, gm) for node in gm.graph.nodes]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return program, TracedGraph(graph_module=gm, nodes=infos, param_bytes=param_bytes,
                                backend="export")  # fmt: skip


class AutoParallelGraph(nn.Module):
    """A model running a per-operator plan (:func:`apply_graph_plan`)."""

    def __init__(
        self,
        graph_module: fx.GraphModule,
        program: torch.export.ExportedProgram,
        specs: dict[str, ParamSpec],
        batch_inputs: set[str],
        defaults: dict[str, Any],
        plan: DagPlan,
        graph: ShardingGraph,
        mesh: TorchDeviceMesh,
        buffer_specs: dict[str, ParamSpec] | None = None,
    ) -> None:
        super().__init__()
        self.graph_module = graph_module
        self.family = "mixed"
        self.plan = plan
        self.graph = graph
        self.mesh = mesh
        self.recompute: Any = None
        self._specs = specs
        self._buffer_specs = buffer_specs or {}
        self._batch_inputs = batch_inputs
        self._defaults = defaults
        self._inputs = [n.name for n in graph_module.graph.nodes if n.op == "placeholder"]
        self._out_spec = program.call_spec.out_spec
        self._summed = [graph_module.get_parameter(s.attr) for s in specs.values() if s.summed]
        if self._summed and mesh.size() > 1:
            reduce_gradients_after_backward(self._summed, mesh.get_group(), average=False)

    @property
    def data_parallel(self) -> bool:
        """``False``: the module takes the whole batch and returns the whole batch's loss on
        every rank (nothing to average), whichever operators split the batch."""
        return False

    def local_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole batch: this module splits its inputs itself, per the plan's layouts."""
        return tensor

    def forward(self, **kwargs: Any) -> Any:
        """Run the plan on the whole batch (the same on every rank)."""
        unknown = sorted(set(kwargs) - set(self._inputs))
        if unknown:
            raise TypeError(
                f"inputs {unknown} were not in the traced inputs {self._inputs}; "
                "autoparallelize the model with them in meta_input_samples."
            )
        group = self.mesh.get_group()
        args = []
        for name in self._inputs:
            value = kwargs.get(name, self._defaults.get(name))
            if name in self._batch_inputs and isinstance(value, torch.Tensor):
                value = graph_comm.constant_part(value, 0, group)
            args.append(value)
        flat = self.graph_module(*args)
        return tree_unflatten(list(flat), self._out_spec)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size by its name in the original model (collective)."""
        return self._gathered(lambda p: p.detach())

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient at full size, by name (collective; zeros where none)."""
        return self._gathered(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))

    def full_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer the graph reads (BatchNorm running statistics) at full size, by its
        name in the original model (collective)."""
        group = self.mesh.get_group()
        result = {}
        for name, spec in self._buffer_specs.items():
            local = self.graph_module.get_buffer(spec.attr).detach()
            result[name] = local.clone() if spec.dim is None else spec.gather(local, group)
        return result

    def _gathered(self, pick: Callable[[nn.Parameter], torch.Tensor]) -> dict[str, torch.Tensor]:
        group = self.mesh.get_group()
        result = {}
        for name, spec in self._specs.items():
            local = pick(self.graph_module.get_parameter(spec.attr))
            result[name] = local if spec.dim is None else spec.gather(local, group)
        return result

    def explain(self) -> str:
        """The plan table (per operator: strategy, layouts, communication, memory)."""
        return f"family {self.family}\n" + format_dag_plan(self.plan, self.graph)

    def print_plan(self) -> None:
        """Print :meth:`explain`."""
        print(self.explain())


def _agreed(plan: DagPlan, graph: ShardingGraph, group: dist.ProcessGroup) -> DagPlan:
    """Rank 0's plan on every rank: the ILP may return different optima of equal cost on
    different ranks, and ranks running different graphs would pair unrelated collectives."""
    picks = [
        next(i for i, s in enumerate(node.strategies) if s is chosen or s == chosen)
        for node, chosen in zip(graph.nodes, plan.strategies, strict=True)
    ]
    shared: list[Any] = [picks]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
    if shared[0] == picks:
        return plan
    return DagPlan(
        nodes=plan.nodes,
        strategies=tuple(n.strategies[i] for n, i in zip(graph.nodes, shared[0], strict=True)),
        reshard_s=plan.reshard_s,
        step_time=plan.step_time,
        memory=plan.memory,
    )


def apply_graph_plan(
    model: nn.Module,
    samples: Mapping[str, Any],
    groups: list[OperatorGroup],
    plan: DagPlan,
    graph: ShardingGraph,
    mesh: TorchDeviceMesh,
) -> AutoParallelGraph:
    """``model`` running ``plan`` (one strategy per operator of ``groups``) over the 1-d
    ``mesh``. The new module shares the model's whole parameters; a sharded one is copied as
    this rank's part and the model's full tensor is freed (the model is consumed, as
    ShardFormer consumes it). Every rank runs rank 0's plan.

    Raises:
        UnsupportedOperatorError: the plan cannot run on this graph (an operator reduces or
            slices a sharded dimension, a size not divisible by the mesh, an operator
            without a sharded form); the message names the node.
    """
    program, traced = export_model(model, samples)
    data = [k for k, v in samples.items() if isinstance(v, torch.Tensor)]
    regrouped = build_module_graph(traced, model, data)
    names = [g.name for g in regrouped]
    if names != [g.name for g in groups] or names != list(plan.nodes):
        raise UnsupportedOperatorError(
            "the model's graph groups differently from the plan's operators; trace and plan "
            "with the same model and inputs."
        )
    group = mesh.get_group()
    plan = _agreed(plan, graph, group)
    strategies = {name: s for name, s in zip(plan.nodes, plan.strategies, strict=True)}
    rewriter = GraphRewriter(
        program, regrouped, strategies, model, mesh.size(), dist.get_rank(group), group
    )
    new_graph, params, specs, constants = rewriter.rewrite()
    holder = nn.Module()
    for attr, tensor in params.items():  # the model's own parameter objects where whole
        param = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
        holder.register_parameter(attr, param)
    for attr, tensor in constants.items():
        holder.register_buffer(attr, tensor)
    gm = fx.GraphModule(holder, new_graph)
    batch_inputs = {
        g.name
        for g in regrouped
        if g.kind == "input"
        and strategies[g.name].out_layout == "B"
        and rewriter.batch_dim(g.name) == 0
    }
    defaults = {k: v for k, v in samples.items() if not isinstance(v, torch.Tensor)}
    return AutoParallelGraph(
        gm, program, specs, batch_inputs, defaults, plan, graph, mesh, rewriter.buffer_specs
    )
