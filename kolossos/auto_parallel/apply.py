"""Turn a solved :class:`~kolossos.auto_parallel.solver.Plan` into a module that trains on P ranks.

Two plan families are implemented exactly:

* **data parallel** (every tensor ``B``): each rank runs the whole model on its slice of the
  batch (:meth:`AutoParallelModule.local_batch`) and every gradient is averaged over the mesh
  by a post-accumulate hook, so the update equals the single-process one on the whole batch;
* **tensor parallel** (tensors ``R`` or ``F``): column/row linears become DTensor
  ``ColwiseParallel``/``RowwiseParallel`` modules over the mesh, replicated operators stay as
  they are, every rank sees the whole batch.

A plan that mixes the families, or changes layout anywhere but at a linear's boundary, raises
:class:`NotImplementedError` naming the node.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from kolossos.auto_parallel.solver import Plan

__all__ = ["AutoParallelModule", "apply_plan", "batch_part", "format_plan"]


def format_plan(plan: Plan, targets: dict[str, str]) -> str:
    """The plan as a table: node, operator, strategy, layouts, communication, memory."""
    lines = [
        f"{'node':<16} {'operator':<20} {'strategy':<8} {'in->out':<8} {'comm MB':>9} "
        f"{'comm ms':>8} {'reshard ms':>10} {'param+opt MB':>12} {'act MB':>8}"
    ]
    for (name, s), move in zip(plan, plan.reshard_s, strict=True):
        lines.append(
            f"{name[:16]:<16} {targets.get(name, '')[:20]:<20} {s.name:<8} "
            f"{s.in_layout + '->' + s.out_layout:<8} {s.comm_bytes / 2**20:>9.3f} "
            f"{s.comm_s * 1e3:>8.3f} {move * 1e3:>10.3f} {s.param_mem / 2**20:>12.3f} "
            f"{s.act_mem / 2**20:>8.3f}"
        )
    lines.append(
        f"input layout {plan.input_layout}; predicted step time {plan.step_time * 1e3:.3f} ms, "
        f"predicted memory per rank {plan.memory / 2**20:.3f} MB"
    )
    return "\n".join(lines)


def batch_part(tensor: torch.Tensor, mesh: TorchDeviceMesh) -> torch.Tensor:
    """This rank's equal slice of dimension 0 of a whole-batch tensor over the 1-d ``mesh``.

    Raises:
        ValueError: the batch does not split evenly over the mesh.
    """
    size, rank = mesh.size(), mesh.get_local_rank()
    if tensor.shape[0] % size:
        raise ValueError(
            f"batch of {tensor.shape[0]} does not split over {size} data-parallel ranks; "
            "use a multiple of the mesh size."
        )
    step = tensor.shape[0] // size
    return tensor[rank * step : (rank + 1) * step]


class AutoParallelModule(nn.Module):
    """The parallel model :func:`~kolossos.auto_parallel.autoparallelize` returns."""

    def __init__(
        self, module: nn.Module, plan: Plan, mesh: TorchDeviceMesh, targets: dict[str, str]
    ) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self.mesh = mesh
        self._targets = targets

    @property
    def data_parallel(self) -> bool:
        """Whether the batch is split over the ranks (the plan's input layout is ``B``)."""
        return self.plan.input_layout == "B"

    def local_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole-batch tensor (inputs and targets): its slice of dimension
        0 under data parallelism, the whole tensor otherwise."""
        return batch_part(tensor, self.mesh) if self.data_parallel else tensor

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Run the parallel model on this rank's input (see :meth:`local_batch`)."""
        return self.module(x, *args, **kwargs)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size (gathers the tensor-parallel shards; collective)."""
        return {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in self.module.named_parameters()
        }

    def explain(self) -> str:
        """The plan table of :func:`format_plan`."""
        return format_plan(self.plan, self._targets)

    def print_plan(self) -> None:
        """Print :meth:`explain`."""
        print(self.explain())


def _data_parallel(module: nn.Module, mesh: TorchDeviceMesh) -> None:
    group, size = mesh.get_group(), mesh.size()

    def average(param: torch.Tensor) -> None:
        assert param.grad is not None
        dist.all_reduce(param.grad, group=group)
        param.grad.div_(size)

    for param in module.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)


def _tensor_parallel(module: nn.Module, plan: Plan, mesh: TorchDeviceMesh) -> None:
    strategies = plan.strategies
    styles: dict[str, ParallelStyle] = {}
    handled: set[int] = set()  # indices whose incoming layout change a linear performs
    for i, (name, s) in enumerate(plan):
        if s.name == "col":
            # Skip the elementwise nodes that keep F; gathering before them is exact.
            j = i + 1
            while j < len(strategies) and strategies[j].name == "F":
                j += 1
            following = strategies[j].in_layout if j < len(strategies) else "R"
            if following == "R":
                styles[name] = ColwiseParallel(output_layouts=Replicate())
                handled.add(j)
            else:
                styles[name] = ColwiseParallel()
        elif s.name == "row":
            # Skip back over elementwise nodes kept in F; slicing after them is exact.
            k = i
            while k > 0 and strategies[k - 1].name == "F":
                k -= 1
            before = plan.input_layout if k == 0 else strategies[k - 1].out_layout
            if before == "R":
                styles[name] = RowwiseParallel(input_layouts=Replicate())
                handled.add(k)
            else:
                styles[name] = RowwiseParallel()
    for i, (name, s) in enumerate(plan):
        incoming = plan.input_layout if i == 0 else strategies[i - 1].out_layout
        if incoming != s.in_layout and i not in handled:
            raise NotImplementedError(
                f"the plan changes layout {incoming} -> {s.in_layout} in front of node {name!r} "
                f"(strategy {s.name}); only changes at a column linear's output or a row "
                "linear's input are implemented."
            )
    final = strategies[-1].out_layout
    if final != "R" and len(strategies) not in handled:
        raise NotImplementedError(
            f"the plan ends in layout {final} at node {plan.nodes[-1]!r}; the loss needs R."
        )
    parallelize_module(module, mesh, styles)


def apply_plan(
    module: nn.Module, plan: Plan, mesh: TorchDeviceMesh, node_targets: dict[str, str]
) -> AutoParallelModule:
    """Parallelise ``module`` in place by ``plan`` over the 1-d ``mesh``.

    ``node_targets`` maps each plan node to its submodule path (``call_module`` nodes).

    Raises:
        NotImplementedError: the plan mixes data and tensor parallelism, or changes layout where
            no linear does it.
    """
    layouts = (
        {plan.input_layout}
        | {s.in_layout for s in plan.strategies}
        | {s.out_layout for s in plan.strategies}
    )
    if layouts == {"B"}:
        _data_parallel(module, mesh)
    elif "B" not in layouts:
        by_path = Plan(
            nodes=tuple(node_targets.get(n, n) for n in plan.nodes),
            strategies=plan.strategies,
            input_layout=plan.input_layout,
            reshard_s=plan.reshard_s,
            step_time=plan.step_time,
            memory=plan.memory,
        )
        _tensor_parallel(module, by_path, mesh)
    else:
        raise NotImplementedError(
            f"the plan mixes data-parallel and tensor-parallel layouts ({sorted(layouts)}); "
            "only pure data-parallel or pure tensor-parallel plans are implemented."
        )
    return AutoParallelModule(module, plan, mesh, node_targets)
