"""The legacy pipeline schedules' step, on kolossos' pipeline runtime.

:class:`LegacyStepExecutor` is the runtime's :class:`~kolossos.pipeline.schedule.executor.
ScheduleExecutor` (one executor for every table: it receives activations and gradients in the
senders' order over :class:`~kolossos.pipeline.p2p.PipelineP2P`, keeps each micro-batch's state
and sends the input gradients back) with the forward of Colossal-AI's legacy schedules: each
stage's inputs follow :mod:`.pipeline_data`, the loss is ``engine.criterion(output, label) /
num_microbatches``, and backward passes go through ``engine.backward(loss)`` /
``engine.backward_by_grad(output, grad)`` so the Engine's optimizer (loss scaling) applies.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from kolossos.amp.fp16_module import FP16Module
from kolossos.booster.mixed_precision.mixed_precision_base import AutocastModel
from kolossos.interface import ModelWrapper
from kolossos.legacy.engine.schedule.base import BaseSchedule
from kolossos.legacy.engine.schedule.pipeline_data import (
    StageDataFunc,
    call_stage,
    check_stage_inputs,
    check_stage_output,
    data_and_label,
)
from kolossos.pipeline.p2p import PipelineP2P
from kolossos.pipeline.schedule.executor import ScheduleExecutor, _as_tensors, _State
from kolossos.pipeline.schedule.microbatch import detach_all
from kolossos.pipeline.schedule.table import Action, ActionKind, Message, ScheduleTable

if TYPE_CHECKING:
    from kolossos.legacy.engine.engine import Engine

__all__ = ["LegacyStepExecutor", "activation_dtype", "forward_only_table", "stage_chunks"]


class EngineBackward:
    """The executor's backward router: the last stage's loss through ``engine.backward``, the
    other stages' outputs through ``engine.backward_by_grad`` (one tensor unwrapped, as the AMP
    optimizers take it).

    kolossos' optimizer wrappers take the *unscaled* upstream gradient in ``backward_by_grad``
    and apply their loss scale to it, as ``backward(loss)`` does to the loss. The gradient a
    stage receives comes from the next stage's backward and carries the scale already, so it is
    unscaled here first, in fp32: for a power-of-two scale the optimizer's product (cast back to
    the output's dtype by autograd) is the received gradient again, bit for bit.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate the last stage's (micro-batch) loss."""
        self.engine.backward(loss)

    def backward_by_grad(self, outputs: list[torch.Tensor], grads: list[Any]) -> None:
        """Back-propagate a stage's outputs with the gradients the next stage sent."""
        scaler = self.engine.optimizer.get_loss_scaler()
        if scaler is not None and scaler.scale != 1.0:
            grads = [g if g is None else g.float() / scaler.scale for g in grads]
        if len(outputs) == 1:
            self.engine.backward_by_grad(outputs[0], grads[0])
        else:
            self.engine.backward_by_grad(outputs, grads)  # type: ignore[arg-type]


def _rewrap(wrapper: nn.Module, chunk: nn.Module) -> nn.Module:
    """A shallow copy of ``wrapper`` (e.g. the AMP model wrapper around a whole ``ModuleList``)
    running ``chunk`` instead: same forward logic (input/output casts, autocast), one chunk."""
    view = copy.copy(wrapper)
    view._modules = dict(wrapper._modules)  # its own table, not the wrapper's
    view._modules["module"] = chunk
    return view


def _chunk_list(model: Any) -> list[nn.Module] | None:
    if isinstance(model, nn.ModuleList):
        return list(model)
    if isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    if isinstance(model, ModelWrapper):
        inner = _chunk_list(model.module)
        return None if inner is None else [_rewrap(model, c) for c in inner]
    return None


def stage_chunks(model: Any, num_chunks: int, schedule: str) -> list[nn.Module]:
    """This rank's model chunks: a list / ``nn.ModuleList`` of them (also inside the AMP model
    wrapper), or one module when ``num_chunks == 1``.

    Raises:
        ValueError: the model does not hold ``num_chunks`` chunks.
    """
    chunks = _chunk_list(model)
    if chunks is None and num_chunks == 1 and isinstance(model, nn.Module):
        chunks = [model]
    if chunks is None or len(chunks) != num_chunks:
        got = "one module" if chunks is None else f"{len(chunks)} chunk(s)"
        raise ValueError(
            f"{schedule} runs {num_chunks} model chunk(s) per pipeline rank but engine.model "
            f"holds {got}; pass this rank's chunks as an nn.ModuleList of {num_chunks} modules "
            "(chunk c of pipeline rank r is virtual stage c * pipeline_size + r), or change "
            "num_model_chunks (the config's NUM_CHUNKS or model=dict(num_chunks=...))."
        )
    return chunks


def activation_dtype(chunk: nn.Module) -> torch.dtype:
    """The dtype of the activations a stage sends (for a fixed ``tensor_shape``): the output
    dtype of the AMP model wrapper (``AMP_TYPE.NAIVE``: fp32 by default; ``AMP_TYPE.TORCH``: the
    autocast dtype), else the dtype of the stage's parameters."""
    module: nn.Module = chunk
    while isinstance(module, (ModelWrapper, nn.parallel.DistributedDataParallel)):
        if isinstance(module, FP16Module):
            return module.output_dtype or torch.float16
        if isinstance(module, AutocastModel):
            return module.dtype
        module = module.module
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def forward_only_table(table: ScheduleTable) -> ScheduleTable:
    """``table`` without its backward actions (evaluation: forwards in the same order)."""
    ranks = tuple(tuple(a for a in acts if a.kind is ActionKind.F) for acts in table.ranks)
    return dataclasses.replace(table, ranks=ranks)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What one legacy step computes."""

    num_microbatches: int
    forward_only: bool
    return_loss: bool
    keep_outputs: bool
    data_func: StageDataFunc | None
    on_chunk: Callable[[int], None]
    """called with the chunk index before each forward (sets gpc's virtual pipeline rank)"""


class LegacyStepExecutor(ScheduleExecutor):
    """One rank's actions of ``table`` for one step of a legacy pipeline schedule.

    Args:
        table: the 1F1B / interleaved table (or its forward-only form).
        position: this rank's pipeline position.
        ranks: the pipeline's global ranks, by position.
        p2p: the point-to-point layer (kept across steps).
        chunks: this rank's model chunks.
        engine: the Engine (criterion, backward, backward_by_grad).
        micro_batches: the step's micro-batches.
        options: what to compute.
    """

    def __init__(
        self,
        table: ScheduleTable,
        position: int,
        ranks: Sequence[int],
        p2p: PipelineP2P,
        chunks: Sequence[nn.Module],
        engine: Engine,
        micro_batches: list[Any],
        options: StepOptions,
    ) -> None:
        criterion = engine.criterion or _no_criterion
        super().__init__(table, position, ranks.__getitem__, p2p, chunks, criterion,
                         EngineBackward(engine), micro_batches)  # fmt: skip
        self.engine = engine
        self.options = options
        self.labels: dict[int, Any] = {}

    def _forward(self, action: Action) -> None:
        c, i, opt = action.chunk, action.microbatch, self.options
        stage = self.t.stage_of(self.pos, c)
        inputs: list[torch.Tensor] = []
        stage_output: Any = None
        if stage > 0:
            inputs, is_tuple = self._take(Message("act", stage, i))
            stage_output = tuple(inputs) if is_tuple else inputs[0]
        data, label = data_and_label(stage_output, self.mbs[i], stage == 0, opt.data_func)
        opt.on_chunk(c)
        check_stage_inputs(self.chunks[c].forward, data, stage, self.pos)
        out = call_stage(self.chunks[c], data)
        check_stage_output(out, stage, self.t.num_stages, self.pos)
        if stage == self.t.num_stages - 1:
            loss = None
            if opt.return_loss:
                loss = BaseSchedule._call_engine_criterion(self.engine, out, label)
                loss = loss / opt.num_microbatches
                self.losses.append(loss.detach())
            if self.keep_outputs:
                self.outputs[i], self.labels[i] = detach_all(out), label
            if not opt.forward_only:
                assert loss is not None  # training needs the loss (checked by the schedule)
                self.states[(c, i)] = _State(inputs, [], loss)
        else:
            outs, is_tuple = _as_tensors(out, stage)
            self._hand_on(Message("act", stage + 1, i), (outs, is_tuple))
            if not opt.forward_only:
                self.states[(c, i)] = _State(inputs, outs)
        if not opt.forward_only:
            self._count(c, +1)


def _no_criterion(*args: Any) -> torch.Tensor:
    raise RuntimeError("the Engine has no criterion: pass criterion= to initialize.")
