"""Run a transformer plan family (:mod:`~kolossos.auto_parallel.transformer_plan`) on P ranks.

* ``dp``: each rank runs the whole model on its slice of the batch (:meth:`local_batch`); at
  the end of backward all gradients are averaged over the mesh in one all-reduce of a flat
  buffer (a tied weight once).
* ``megatron``: :class:`~kolossos.shardformer.ShardFormer` with the model family's built-in
  policy over the mesh's group (GPT-2: fused ``c_attn`` split per head, ``c_proj`` row, ``c_fc``
  column, vocabulary-parallel ``wte``/``lm_head`` and cross entropy); every rank sees the whole
  batch.
* ``replicated``: the model unchanged, every rank the whole batch;
* ``dp{D}xtp{T}``: the ranks as a ``D × T`` mesh (the user's 2-d mesh when given); ShardFormer
  over each ``T``-rank group (its ``1/D`` of the batch), the flat gradient all-reduce over each
  ``D``-rank group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.device_mesh import init_device_mesh

from kolossos.auto_parallel.apply import batch_part
from kolossos.auto_parallel.grad_sync import reduce_gradients_after_backward
from kolossos.auto_parallel.sharding_graph import DagPlan, ShardingGraph
from kolossos.auto_parallel.transformer_plan import format_dag_plan, parse_hybrid
from kolossos.nn.layer.parallel_1d import gather_tp_full, get_tp_spec
from kolossos.shardformer import ShardConfig, ShardFormer

__all__ = ["AutoParallelTransformer", "apply_family"]


class AutoParallelTransformer(nn.Module):
    """The parallel transformer :func:`~kolossos.auto_parallel.autoparallelize` returns."""

    def __init__(
        self,
        module: nn.Module,
        family: str,
        plan: DagPlan,
        graph: ShardingGraph,
        mesh: TorchDeviceMesh,
    ) -> None:
        super().__init__()
        self.module = module
        self.family = family
        self.plan = plan
        self.graph = graph
        self.mesh = mesh

        self.batch_mesh: TorchDeviceMesh | None = None
        """The mesh (axis) the batch is split over; ``None``: every rank the whole batch."""
        self.recompute: Any = None
        """The :class:`~kolossos.auto_parallel.transformer_checkpoint.BlockCheckpoint` applied
        (which blocks are recomputed), or ``None``: no activation checkpointing."""

    @property
    def data_parallel(self) -> bool:
        """Whether the batch is split over ranks (``dp`` and the ``dp × tp`` families)."""
        return self.batch_mesh is not None

    def local_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole-batch tensor: its slice of dimension 0 under data
        parallelism, the whole tensor otherwise."""
        return tensor if self.batch_mesh is None else batch_part(tensor, self.batch_mesh)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the parallel model on this rank's inputs (see :meth:`local_batch`)."""
        return self.module(*args, **kwargs)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size (gathers tensor-parallel shards; collective)."""
        result = {}
        for name, param in self.module.named_parameters():
            spec = get_tp_spec(param)
            result[name] = (gather_tp_full(param, spec) if spec is not None else param).detach()
        return result

    def explain(self) -> str:
        """The plan table (per operator: strategy, layouts, communication, memory), and the
        blocks recomputed with the predicted memory and time when checkpointing is on."""
        text = f"family {self.family}\n" + format_dag_plan(self.plan, self.graph)
        if self.recompute is not None:
            text += "\n" + self.recompute.describe()
        return text

    def print_plan(self) -> None:
        """Print :meth:`explain`."""
        print(self.explain())


def _average(module: nn.Module, mesh: TorchDeviceMesh) -> None:
    """Every gradient averaged over ``mesh`` after each backward (a tied weight once)."""
    params = [p for p in module.parameters() if p.requires_grad]
    reduce_gradients_after_backward(params, mesh.get_group(), average=True)


def apply_family(
    module: nn.Module,
    family: str,
    plan: DagPlan,
    graph: ShardingGraph,
    mesh: TorchDeviceMesh,
    *,
    grid: TorchDeviceMesh | None = None,
) -> AutoParallelTransformer:
    """Parallelise ``module`` in place as ``family`` over the 1-d ``mesh``. A ``dp × tp``
    family runs on ``grid``, a 2-d mesh with axes named ``("dp", "tp")`` (the user's), or
    without one lays the ranks of ``mesh`` out as a ``D × T`` mesh itself.

    Raises:
        ValueError: an unknown family, a ``grid`` of another shape than the family's, or
            ShardFormer's checks (sizes divisible by the mesh).
    """
    batch_mesh: TorchDeviceMesh | None = None
    shape = parse_hybrid(family)
    if family == "dp":
        _average(module, mesh)
        batch_mesh = mesh
    elif family == "megatron":
        config = ShardConfig(tensor_parallel_process_group=mesh.get_group())
        module, _ = ShardFormer(config).optimize(module)
    elif shape is not None:
        if shape[0] * shape[1] != mesh.size():
            raise ValueError(f"family {family!r} needs {shape[0] * shape[1]} ranks.")
        if grid is None:
            grid = init_device_mesh(mesh.device_type, shape, mesh_dim_names=("dp", "tp"))
        elif (grid["dp"].size(), grid["tp"].size()) != shape:
            raise ValueError(
                f"family {family!r} needs a {shape[0]} x {shape[1]} mesh; the given grid is "
                f"{grid['dp'].size()} x {grid['tp'].size()} (dp x tp)."
            )
        config = ShardConfig(tensor_parallel_process_group=grid["tp"].get_group())
        module, _ = ShardFormer(config).optimize(module)
        _average(module, grid["dp"])
        batch_mesh = grid["dp"]
    elif family != "replicated":
        raise ValueError(
            f"family={family!r} must be 'dp', 'megatron', 'replicated' or 'dp<D>xtp<T>'."
        )
    result = AutoParallelTransformer(module, family, plan, graph, mesh)
    result.batch_mesh = batch_mesh
    return result
