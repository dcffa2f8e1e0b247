"""Pipeline parallelism inside :class:`HybridParallelPlugin` (``pp_size > 1``).

The pieces come from :mod:`kolossos.pipeline` (stage manager, schedules) and
:mod:`kolossos.shardformer.pipeline` (stage chunks cut along the plan's layout). This module
composes them:

1. the layout's blocks are split over the virtual stages (``num_layers_per_stage`` or uniform);
   this rank keeps the chunks of its stages (:class:`~kolossos.shardformer.pipeline.StageRange`);
2. parameters tied across stages (GPT-2's ``wte`` on the first stage and ``lm_head`` on the
   last) keep one copy per pipeline position; the copies start equal (broadcast) and their
   gradients are summed over the positions after every step, so they stay equal. Clipping and
   checkpoints count such a parameter once (the copy of the lowest position);
3. a step runs the schedule with the loss multiplied by the optimizer's loss scale (fp16) and
   divided by the data-parallel size (ZeRO sums), so every backward is plain autograd and works
   with the split backwards of the zero-bubble schedules; then the tied gradients are summed
   and, without ZeRO, the gradients averaged over the data-parallel group (no DDP: it cannot
   follow several forwards before their backwards). The batch is moved to the device and its
   floating tensors cast to the working dtype, as the unpipelined model does with its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.booster.plugin.hybrid.config import HybridParallelConfig
from kolossos.booster.plugin.hybrid.grad_norm import DUPLICATE_ATTR
from kolossos.booster.plugin.hybrid.mesh import HybridMesh
from kolossos.booster.plugin.hybrid.sp_grads import all_reduce_coalesced
from kolossos.booster.plugin.hybrid.tp_state import comm_device

__all__ = ["PipelineRuntime", "TiedGroup"]


@dataclass
class TiedGroup:
    """One parameter tied across pipeline positions."""

    names: list[str]
    """Its names in the whole model (the first is the one checkpoints use)."""
    positions: list[int]
    """Pipeline positions holding a copy (sorted)."""
    group: dist.ProcessGroup | None = None
    """This rank's group over those positions (``None`` if this rank holds no copy)."""
    param: nn.Parameter | None = None
    """This rank's copy."""


@dataclass
class PipelineRuntime:
    """The pipeline of one rank: its chunks, schedule and tied parameters."""

    config: HybridParallelConfig
    mesh: HybridMesh
    stage_manager: Any = None
    schedule: Any = None
    tied: list[TiedGroup] = field(default_factory=list)
    names: dict[torch.Tensor, str] = field(default_factory=dict)
    """whole-model (first) name of every parameter this rank holds"""
    full_layout: Any = None
    """the whole model's :class:`~kolossos.checkpoint_io.state_check.ModelLayout` (full shapes)"""

    def __post_init__(self) -> None:
        from kolossos.pipeline import PipelineStageManager, create_schedule

        c = self.config
        layout = "v" if c.pp_style == "zbv" else "loop"
        self.stage_manager = PipelineStageManager(
            self.mesh.mesh, "pp", num_model_chunks=c.num_model_chunks, layout=layout
        )
        sizes = (
            {"num_microbatches": c.num_microbatches}
            if c.num_microbatches is not None
            else {"microbatch_size": c.microbatch_size}
        )
        self.schedule = create_schedule(
            c.pp_style, self.stage_manager, enable_metadata_cache=c.enable_metadata_cache, **sizes
        )

    # ------------------------------------------------------------------ building
    def stage_ranges(self, num_layers: int) -> list[Any]:
        """This rank's :class:`StageRange` per chunk."""
        from kolossos.shardformer.pipeline import StageRange

        sm = self.stage_manager
        counts = self.config.num_layers_per_stage or sm.distribute_layers(num_layers)
        if sum(counts) != num_layers:
            raise ValueError(
                f"num_layers_per_stage={list(counts)} adds up to {sum(counts)} but the model has "
                f"{num_layers} blocks; give counts summing to {num_layers}."
            )
        ranges = []
        for chunk, (start, end) in enumerate(sm.get_stage_index(counts)):
            ranges.append(
                StageRange(
                    start=start,
                    end=end,
                    first=sm.is_first_stage(chunk),
                    last=sm.is_last_stage(chunk),
                )
            )
        return ranges

    def split(self, model: nn.Module, policy: Any) -> nn.ModuleList:
        """This rank's chunks of the (tensor-parallel) ``model``; records names, the full
        layout and the tied groups (a collective: creates the tied groups)."""
        from kolossos.checkpoint_io.state_check import ModelLayout
        from kolossos.nn.layer.parallel_1d.sharding import get_tp_spec
        from kolossos.shardformer.pipeline import build_stage_chunk, check_layout_covers, layout_of

        layout = layout_of(model, policy)
        check_layout_covers(model, layout)
        state = model.state_dict(keep_vars=True)
        aliases = ModelLayout.of_state_dict(state).aliases
        shapes = {}
        for name, tensor in state.items():
            spec = get_tp_spec(tensor)
            shapes[name] = spec.full_shape if spec is not None else tuple(tensor.shape)
        self.full_layout = ModelLayout(shapes, aliases)
        blocks = model.get_submodule(layout.blocks)
        assert isinstance(blocks, nn.ModuleList), layout.blocks
        num_layers = len(blocks)
        ranges = self.stage_ranges(num_layers)
        chunks = nn.ModuleList([build_stage_chunk(model, layout, r) for r in ranges])
        first: dict[torch.Tensor, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            first.setdefault(param, name)
        local: set[torch.Tensor] = {p for chunk in chunks for p in chunk.parameters()}
        self.names = {p: n for p, n in first.items() if p in local}
        self._find_tied(model, layout, num_layers, local)
        return chunks

    def _position_of(self, name: str, layout: Any, counts: Sequence[int]) -> int:
        """The pipeline position of the stage owning parameter ``name``."""
        sm = self.stage_manager
        if any(name.startswith(p + ".") for p in layout.embeddings):
            return int(sm.owner(0)[0])
        if any(name.startswith(p + ".") for p in layout.final):
            return int(sm.owner(sm.num_virtual_stages - 1)[0])
        index = int(name[len(layout.blocks) + 1 :].split(".")[0])
        bound = 0
        for stage, count in enumerate(counts):
            bound += count
            if index < bound:
                return int(sm.owner(stage)[0])
        raise AssertionError(name)

    def _find_tied(
        self, model: nn.Module, layout: Any, num_layers: int, local: set[torch.Tensor]
    ) -> None:
        from kolossos.cluster.mesh_math import all_groups

        counts = self.config.num_layers_per_stage or self.stage_manager.distribute_layers(
            num_layers
        )
        by_param: dict[nn.Parameter, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            by_param.setdefault(param, []).append(name)
        mesh = self.mesh.mesh
        pipelines = all_groups(mesh.shape, (mesh.axis_index("pp"),))
        for param, names in by_param.items():
            positions = sorted({self._position_of(n, layout, counts) for n in names})
            if len(positions) < 2:
                continue
            tied = TiedGroup(names=names, positions=positions)
            for line in pipelines:
                ranks = [line[p] for p in positions]
                group = dist.new_group(ranks)  # SYNC POINT: every rank creates every group
                if dist.get_rank() in ranks:
                    tied.group = group
            if param in local:
                tied.param = param
                if self.stage_manager.stage != positions[0]:
                    setattr(param, DUPLICATE_ATTR, True)
            self.tied.append(tied)

    def check_tied_supported(self) -> None:
        """ZeRO-2 keeps no full gradients to sum tied copies over the stages.

        Raises:
            NotImplementedError: tied weights across stages with ``zero_stage=2``.
        """
        if self.tied and self.config.zero_stage == 2:
            raise NotImplementedError(
                f"zero_stage=2 with pp_size={self.config.pp_size} and weights tied across "
                f"stages ({self.tied[0].names}): ZeRO-2 frees full gradients before they can be "
                "summed over the stages; use zero_stage=1, or untie the weights."
            )

    @torch.no_grad()
    def broadcast_tied(self) -> None:
        """Make every copy of a tied parameter equal to the first position's (a collective)."""
        sm = self.stage_manager
        for tied in self.tied:
            if tied.param is None or tied.group is None:
                continue
            src = sm.global_rank(tied.positions[0])
            data = tied.param.data
            buf = data.to(comm_device(tied.group))
            dist.broadcast(buf, src=src, group=tied.group)  # SYNC POINT
            data.copy_(buf)

    # ------------------------------------------------------------------ a step
    def _synced_tied(self) -> list[TiedGroup]:
        return [t for t in self.tied if t.param is not None and t.group is not None]

    @torch.no_grad()
    def stash_tied_grads(self) -> list[torch.Tensor | None]:
        """Take out the tied gradients accumulated by earlier steps (already summed, equal on
        every copy), so that only this step's part is summed over the stages."""
        stash: list[torch.Tensor | None] = []
        for tied in self._synced_tied():
            grad = tied.param.grad if tied.param is not None else None
            stash.append(None if grad is None else grad.clone())
            if grad is not None:
                grad.zero_()  # in place: ZeRO-1's gradients are views of its flat buffer
        return stash

    @torch.no_grad()
    def sync_tied_grads(self, stash: list[torch.Tensor | None]) -> None:
        """Sum each tied parameter's gradient of this step over the positions holding it, then
        add back what :meth:`stash_tied_grads` took out (in place, views stay views)."""
        for tied, earlier in zip(self._synced_tied(), stash, strict=True):
            param = tied.param
            assert param is not None and tied.group is not None
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            buf = grad.to(comm_device(tied.group))
            dist.all_reduce(buf, group=tied.group)  # SYNC POINT
            grad.copy_(buf)
            if earlier is not None:
                grad.add_(earlier)

    @torch.no_grad()
    def average_dp_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Average the gradients over the data-parallel group (zero_stage 0, dp > 1)."""
        group = self.mesh.dp_group
        size = dist.get_world_size(group)
        if size == 1:
            return
        grads = []
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad is not None:
                grads.append(p.grad)
        all_reduce_coalesced(grads, group, comm_device(group))
        for g in grads:
            g.div_(size)

    # ------------------------------------------------------------------ checkpoint transport
    def send_item(self, name: str | None, tree: dict[str, Any]) -> None:
        """Send one checkpoint item (``name`` and its values: tensors and plain values) to the
        checkpoint writer, pipeline position 0 of this pipeline; ``name=None`` ends the stream.
        The structure travels as an object, then each tensor."""
        group, writer = self.stage_manager.group, self.stage_manager.global_rank(0)
        tensors = {k: v for k, v in tree.items() if isinstance(v, torch.Tensor)}
        head = {
            k: ("t", tuple(v.shape), v.dtype) if k in tensors else ("v", v) for k, v in tree.items()
        }
        dist.send_object_list([None if name is None else (name, head)], dst=writer, group=group)
        for value in tensors.values():
            dist.send(_transport(value, group), dst=writer, group=group)  # SYNC POINT

    def receive_items(self, position: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """On the writer: the items pipeline position ``position`` sends, until its end."""
        group, src = self.stage_manager.group, self.stage_manager.global_rank(position)
        while True:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=src, group=group)  # SYNC POINT
            if box[0] is None:
                return
            name, head = box[0]
            tree: dict[str, Any] = {}
            for key, (kind, *rest) in head.items():
                if kind == "v":
                    tree[key] = rest[0]
                    continue
                buf = _transport(torch.empty(rest[0], dtype=rest[1]), group)
                dist.recv(buf, src=src, group=group)
                tree[key] = buf.cpu()
            yield name, tree

    def run(
        self,
        chunks: nn.ModuleList,
        data_iter: Iterator[Any],
        criterion: Callable[..., torch.Tensor],
        optimizer: Any,
        return_loss: bool,
        return_outputs: bool,
    ) -> dict[str, Any]:
        """One step: schedule (scaled loss), tied sum, data-parallel average. Several calls
        before ``optimizer.step()`` accumulate gradients correctly (the tied sum covers each
        call's part once; averaging already-equal gradients again changes nothing)."""
        factor, scope, backward = _backward_plan(optimizer)
        device = next(chunks.parameters()).device
        batches = (_on_device(batch, self.config.dtype, device) for batch in data_iter)

        def scaled(output: Any, target: Any) -> torch.Tensor:
            loss = criterion(output, target)
            return loss * factor if factor != 1.0 else loss

        stash = self.stash_tied_grads()
        with scope:
            result = self.schedule.forward_backward_step(
                chunks, batches, scaled, backward, return_loss, return_outputs
            )
        if result.get("loss") is not None and factor != 1.0:
            result["loss"] = result["loss"] / factor
        self.sync_tied_grads(stash)
        if self.config.zero_stage == 0:
            self.average_dp_grads([p for p in chunks.parameters()])
        return result


def _transport(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` where ``group``'s backend sends from (the CPU for gloo), contiguous."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return tensor.detach().cpu().contiguous()
    from kolossos.accelerator import get_accelerator

    return tensor.detach().to(get_accelerator().get_current_device()).contiguous()


def _on_device(value: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """``value`` with its tensors on ``device`` and floating ones in the working ``dtype`` (as
    the unpipelined model casts its inputs)."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _on_device(v, dtype, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_on_device(v, dtype, device) for v in value)
    return value


class _Zero2Backward:
    """Routes each backward of a schedule through ZeRO-2's reducer (one reduction per pass;
    the loss is already scaled)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def backward(self, loss: torch.Tensor) -> None:
        self.optimizer._run_backward(lambda factor: loss.backward())

    def backward_by_grad(self, tensors: Any, grads: Any) -> None:
        self.optimizer._run_backward(lambda factor: torch.autograd.backward(tensors, grads))


def _backward_plan(optimizer: Any) -> tuple[float, AbstractContextManager[Any], Any]:
    """``(loss factor, context around the schedule, backward router for the schedule)``."""
    from kolossos.booster.plugin.hybrid.zero_optimizer import HybridZeroOptimizer

    if isinstance(optimizer, HybridZeroOptimizer):
        factor = float(optimizer.loss_scale) / optimizer.comm.world_size
        if optimizer.reducer.partition_grads:
            return factor, nullcontext(), _Zero2Backward(optimizer)
        return factor, optimizer.accumulate_locally(), None
    scaler = getattr(optimizer, "scaler", None)
    factor = float(scaler.scale) if scaler is not None else 1.0
    return factor, nullcontext(), None
