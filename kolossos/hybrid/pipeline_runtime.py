"""Pipeline parallelism inside the hybrid engine (``pp_size > 1``).

The pieces come from :mod:`kolossos.pipeline` (stage manager, schedules, shared parameters) and
:mod:`kolossos.shardformer.pipeline` (stage chunks cut along the plan's layout). This module
composes them:

1. the layout's blocks are split over the virtual stages (``num_layers_per_stage`` or uniform);
   this rank keeps the chunks of its stages (:class:`~kolossos.shardformer.pipeline.StageRange`);
   with Megatron sequence parallelism (``'split_gather'``) a later stage takes the
   ``(micro-batch, S / tp, H)`` shard the previous one sends (:mod:`.stage_sequence`);
2. parameters tied across stages (GPT-2's ``wte`` on the first stage and ``lm_head`` on the
   last) keep one copy per pipeline position, registered with a
   :class:`~kolossos.pipeline.PipelineSharedModuleWrapper`: the copies start equal and the
   schedule sums their gradients over the positions after every step, so they stay equal.
   Clipping and checkpoints count such a parameter once (the copy of the lowest position);
3. a step runs the schedule with the loss multiplied by the optimizer's loss scale (fp16) and
   divided by the data-parallel size (ZeRO sums), so every backward is plain autograd and works
   with the split backwards of the zero-bubble schedules; then, without ZeRO, the gradients are
   averaged over the data-parallel group, ``dp x sp`` with a sequence-parallel axis (no DDP: it
   cannot follow several forwards before their backwards). The batch is moved to the device and
   its floating tensors cast to the working dtype, as the unpipelined model does with its
   inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.amp import cast_floating
from kolossos.checkpoint_io.state_check import ModelLayout
from kolossos.cluster.collectives import all_reduce_coalesced
from kolossos.hybrid.config import HybridParallelConfig
from kolossos.hybrid.mesh import HybridMesh
from kolossos.hybrid.stage_sequence import install_stage_sequence_shards
from kolossos.hybrid.zero_optimizer import HybridZeroOptimizer
from kolossos.interface import OptimizerWrapper
from kolossos.nn.layer.parallel_1d.sharding import get_tp_spec
from kolossos.pipeline import PipelineSharedModuleWrapper, PipelineStageManager, create_schedule
from kolossos.pipeline.schedule import PipelineSchedule, schedule_spec
from kolossos.shardformer.pipeline import (
    StageRange,
    build_stage_chunk,
    check_layout_covers,
    layout_of,
)
from kolossos.shardformer.policies.base_policy import StageLayout
from kolossos.shardformer.sharder import SHARDED_ATTR, ShardedState

__all__ = ["PipelineRuntime", "TiedParameter"]


@dataclass(frozen=True)
class TiedParameter:
    """One parameter tied across pipeline positions."""

    names: list[str]
    """Its names in the whole model (the first is the one checkpoints use)."""
    wrapper: PipelineSharedModuleWrapper
    """The shared-parameter wrapper over the positions holding a copy."""
    param: nn.Parameter | None
    """This rank's copy (``None`` if this rank holds none)."""


class PipelineRuntime:
    """The pipeline of one rank: its stage manager, schedule, chunks' names and tied parameters.

    Args:
        config: the engine's configuration (``pp_size > 1``).
        mesh: the engine's process mesh.
    """

    def __init__(self, config: HybridParallelConfig, mesh: HybridMesh) -> None:
        self.config = config
        self.mesh = mesh
        c = config
        self.stage_manager = PipelineStageManager(
            mesh.mesh, "pp", num_model_chunks=c.num_model_chunks,
            layout=schedule_spec(c.pp_style).layout,
        )  # fmt: skip
        sizes = (
            {"num_microbatches": c.num_microbatches}
            if c.num_microbatches is not None
            else {"microbatch_size": c.microbatch_size}
        )
        self.schedule: PipelineSchedule = create_schedule(
            c.pp_style, self.stage_manager, enable_metadata_cache=c.enable_metadata_cache, **sizes
        )
        self.tied: list[TiedParameter] = []
        #: whole-model (first) name of every parameter this rank holds
        self.names: dict[torch.Tensor, str] = {}
        #: the whole model's names and full shapes (set by :meth:`split`)
        self.full_layout = ModelLayout({}, {})

    # ------------------------------------------------------------------ building
    def stage_ranges(self, num_layers: int) -> list[StageRange]:
        """This rank's :class:`StageRange` per chunk."""
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
        layout and the tied parameters (a collective: creates their groups)."""
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
        shards = getattr(model, SHARDED_ATTR, None)
        if isinstance(shards, ShardedState) and shards.config.sequence_parallel:
            # Megatron SP (split_gather): the stages exchange sequence shards over TP
            boundary = shards.plan.sequence
            seq_dim = boundary.seq_dim if boundary is not None else 1
            install_stage_sequence_shards(chunks, blocks, self.config.tp_size, seq_dim)
        return chunks

    def _position_of(self, name: str, layout: StageLayout, counts: Sequence[int]) -> int:
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
        self, model: nn.Module, layout: StageLayout, num_layers: int, local: set[torch.Tensor]
    ) -> None:
        counts = self.config.num_layers_per_stage or self.stage_manager.distribute_layers(
            num_layers
        )
        by_param: dict[nn.Parameter, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            by_param.setdefault(param, []).append(name)
        for param, names in by_param.items():
            positions = sorted({self._position_of(n, layout, counts) for n in names})
            if len(positions) < 2:
                continue
            # SYNC POINT: every rank creates every wrapper's groups, in model order
            wrapper = PipelineSharedModuleWrapper(positions, self.stage_manager)
            mine = param if param in local else None
            self.tied.append(TiedParameter(names, wrapper, mine))

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

    def register_tied(self) -> None:
        """Register this rank's tied copies with their wrappers: every copy becomes equal to
        the first position's, and from now on the schedule sums their gradients (a collective
        of each tied group)."""
        for tied in self.tied:
            if tied.param is not None:
                tied.wrapper.register_parameter(tied.param)

    # ------------------------------------------------------------------ a step
    @torch.no_grad()
    def average_dp_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Average the gradients over the replicas (zero_stage 0): the data-parallel group, or
        ``dp x sp`` with a sequence-parallel axis (each SP rank holds its shard's share)."""
        group = self.mesh.replica_group
        size = dist.get_world_size(group)
        if size == 1:
            return
        grads = []
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad is not None:
                grads.append(p.grad)
        all_reduce_coalesced(grads, group)
        for g in grads:
            g.div_(size)

    def backward_plan(
        self, optimizer: OptimizerWrapper | None
    ) -> tuple[float, AbstractContextManager[Any], Any]:
        """``(loss factor, context around the schedule, backward router for the schedule)``
        for ``optimizer`` (a subclass may plan for its own optimizers)."""
        return _backward_plan(optimizer)

    def run(
        self,
        chunks: nn.ModuleList,
        data_iter: Iterator[Any],
        criterion: Callable[..., torch.Tensor],
        optimizer: OptimizerWrapper | None,
        return_loss: bool,
        return_outputs: bool,
    ) -> dict[str, Any]:
        """One step: schedule (scaled loss), tied sum, data-parallel average. Several calls
        before ``optimizer.step()`` accumulate gradients correctly (the tied sum covers each
        call's part once; averaging already-equal gradients again changes nothing).

        Under ``torch.no_grad()`` the step is forward-only (evaluation): the schedule runs only
        its forwards, with the unscaled loss, and no gradient is made, summed or averaged.
        """
        if not torch.is_grad_enabled():
            device = next(chunks.parameters()).device
            batches = (cast_floating(batch, self.config.dtype, device) for batch in data_iter)
            return self.schedule.forward_backward_step(
                chunks, batches, criterion, None, return_loss, return_outputs
            )
        factor, scope, backward = self.backward_plan(optimizer)
        device = next(chunks.parameters()).device
        batches = (cast_floating(batch, self.config.dtype, device) for batch in data_iter)

        def scaled(output: Any, target: Any) -> torch.Tensor:
            loss = criterion(output, target)
            return loss * factor if factor != 1.0 else loss

        with scope:  # the schedule sums the tied gradients over the stages
            result = self.schedule.forward_backward_step(
                chunks, batches, scaled, backward, return_loss, return_outputs
            )
        if result.get("loss") is not None and factor != 1.0:
            result["loss"] = result["loss"] / factor
        if self.config.zero_stage == 0:
            self.average_dp_grads([p for p in chunks.parameters()])
        return result


class _Zero2Backward:
    """Routes each backward of a schedule through ZeRO-2's reducer (one reduction per pass;
    the loss is already scaled)."""

    def __init__(self, optimizer: HybridZeroOptimizer) -> None:
        self.optimizer = optimizer

    def backward(self, loss: torch.Tensor) -> None:
        with self.optimizer.backward_pass(sync=True):
            loss.backward()

    def backward_by_grad(self, tensors: Any, grads: Any) -> None:
        with self.optimizer.backward_pass(sync=True):
            torch.autograd.backward(tensors, grads)


def _backward_plan(
    optimizer: OptimizerWrapper | None,
) -> tuple[float, AbstractContextManager[Any], Any]:
    """``(loss factor, context around the schedule, backward router for the schedule)``."""
    if isinstance(optimizer, HybridZeroOptimizer):
        factor = float(optimizer.loss_scale) / optimizer.comm.world_size
        if optimizer.reducer.partition_grads:
            return factor, nullcontext(), _Zero2Backward(optimizer)
        return factor, optimizer.accumulate_locally(), None
    scaler = optimizer.get_loss_scaler() if optimizer is not None else None
    factor = float(scaler.scale) if scaler is not None else 1.0
    return factor, nullcontext(), None
