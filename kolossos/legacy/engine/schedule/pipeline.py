"""``PipelineSchedule``: Colossal-AI's legacy non-interleaved 1F1B schedule, run on kolossos'
pipeline runtime (its 1F1B table, executor and point-to-point layer) over ``gpc``'s PIPELINE
group."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.engine.schedule.base import BaseSchedule, StepResult
from kolossos.legacy.engine.schedule.pipeline_data import (
    StageDataFunc,
    merge_micro,
    split_micro_batches,
)
from kolossos.legacy.engine.schedule.pipeline_executor import (
    LegacyStepExecutor,
    StepOptions,
    activation_dtype,
    forward_only_table,
    stage_chunks,
)
from kolossos.legacy.engine.schedule.scatter_gather import ScatterGatherP2P
from kolossos.pipeline.p2p import P2PStats, PipelineP2P
from kolossos.pipeline.schedule.registry import build_table
from kolossos.pipeline.schedule.table import ScheduleTable

if TYPE_CHECKING:
    from kolossos.legacy.engine.engine import Engine

__all__ = ["PipelineSchedule"]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1.")
    return value


def _shape(tensor_shape: Any) -> torch.Size | None:
    if tensor_shape is None:
        return None
    if isinstance(tensor_shape, int) or not isinstance(tensor_shape, Sequence):
        raise TypeError(
            f"tensor_shape={tensor_shape!r} must be a torch.Size, list or tuple of ints (the "
            "shape of one micro-batch's activation, e.g. (BATCH_SIZE // NUM_MICRO_BATCHES, "
            "SEQ_LEN, HIDDEN)), or None to exchange shapes."
        )
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in tensor_shape):
        raise ValueError(f"tensor_shape={tuple(tensor_shape)} must hold positive ints.")
    return torch.Size(tensor_shape)


def _tp_1d_size() -> int:
    if not gpc.is_initialized(ParallelMode.PARALLEL_1D):
        return 1
    return gpc.get_world_size(ParallelMode.PARALLEL_1D)


class PipelineSchedule(BaseSchedule):
    """Non-interleaved 1F1B over the pipeline stages (Colossal-AI's ``PipelineSchedule``).

    ``engine.model`` is this rank's stage. Each step cuts the batch into ``num_microbatches``
    along dim 0; pipeline rank ``r`` of ``p`` runs ``p - r - 1`` warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards. The first stage takes the
    batch's data, the others the previous stage's output; the last stage computes
    ``engine.criterion(output, label) / num_microbatches`` per micro-batch and back-propagates it
    with ``engine.backward``, the others ``engine.backward_by_grad(output, grad)``.

    Args:
        num_microbatches: micro-batches per step (the config's ``NUM_MICRO_BATCHES``).
        data_process_func: ``f(stage_output, micro_batch) -> (data, label)``, called on every
            stage for every micro-batch (``stage_output`` is ``None`` on the first stage).
        tensor_shape: the shape of the activation between stages for one micro-batch (the
            config's ``TENSOR_SHAPE``): nothing but the tensor travels. ``None``: the shapes are
            sent with the first micro-batch of each step (they may change between steps).
        scatter_gather_tensors: under 1D tensor parallelism (``gpc``'s ``PARALLEL_1D`` group
            larger than one; ignored otherwise, as upstream), each rank sends ``1/tp`` of every
            activation and gradient and the receiving tensor group all-gathers them
            (:mod:`.scatter_gather`). ``kolossos.initialize`` turns it on under
            ``tensor=dict(mode='1d')``.
        tensor_dtype: the activation dtype with ``tensor_shape`` (kolossos' addition; default:
            inferred from the stage, fp32 unless the stage computes in another dtype).

    Raises:
        ValueError: ``num_microbatches`` < 1, a bad ``tensor_shape``, or a
            ``data_process_func`` that does not take two parameters.

    Example:
        >>> # config: parallel=dict(pipeline=2), NUM_MICRO_BATCHES=4
        >>> schedule = PipelineSchedule(num_microbatches=4)  # doctest: +SKIP
        >>> data = iter(loader)  # doctest: +SKIP
        >>> output, label, loss = schedule.forward_backward_step(engine, data)  # doctest: +SKIP
    """

    num_model_chunks: int = 1
    _table_name = "1f1b"

    def __init__(
        self,
        num_microbatches: int,
        data_process_func: StageDataFunc | None = None,
        tensor_shape: torch.Size | Sequence[int] | None = None,
        scatter_gather_tensors: bool = False,
        *,
        tensor_dtype: torch.dtype | None = None,
    ) -> None:
        if data_process_func is not None:
            count = len(inspect.signature(data_process_func).parameters)
            if count != 2:
                raise ValueError(
                    f"data_process_func takes {count} parameters; the pipeline schedules call it "
                    "with two: data_process_func(stage_output, micro_batch) -> (data, label)."
                )
        super().__init__(cast(Any, data_process_func))
        self.num_microbatches = _positive_int("num_microbatches", num_microbatches)
        self.tensor_shape = _shape(tensor_shape)
        self.scatter_gather_tensors = bool(scatter_gather_tensors) and _tp_1d_size() > 1
        self.dtype: torch.dtype | None = tensor_dtype
        self._stage_func: StageDataFunc | None = data_process_func
        self._tables: dict[tuple[int, bool], ScheduleTable] = {}
        self.last_p2p_stats: P2PStats | None = None
        """what the last step sent and received (bytes, messages)"""

    # --- the pipeline seen from this rank ----------------------------------------------------
    @staticmethod
    def _pipeline() -> tuple[int, int, list[int], Any]:
        """``(size, position, global ranks, group)`` of this rank's pipeline (one stage without
        a PIPELINE group)."""
        if not gpc.is_initialized(ParallelMode.PIPELINE):
            return 1, 0, [gpc.get_global_rank()], None
        return (
            gpc.get_world_size(ParallelMode.PIPELINE),
            gpc.get_local_rank(ParallelMode.PIPELINE),
            gpc.get_ranks_in_group(ParallelMode.PIPELINE),
            gpc.get_group(ParallelMode.PIPELINE),
        )

    def chunks_of(self, engine: Engine) -> list[nn.Module]:
        """This rank's model chunks in ``engine.model`` (checked against the chunk count)."""
        return stage_chunks(engine.model, self.num_model_chunks, type(self).__name__)

    def pre_processing(self, engine: Engine) -> None:
        """Check ``engine.model`` (run by the Engine when it takes this schedule): it must hold
        this schedule's chunk count. Fixes the activation dtype of a ``tensor_shape``."""
        chunks = self.chunks_of(engine)
        if self.dtype is None:
            self.dtype = activation_dtype(chunks[0])

    def _table(self, pp_size: int, forward_only: bool) -> ScheduleTable:
        key = (pp_size, forward_only)
        if key not in self._tables:
            table = build_table(self._table_name, pp_size, self.num_microbatches,
                                self.num_model_chunks)  # fmt: skip
            self._tables[key] = forward_only_table(table) if forward_only else table
        return self._tables[key]

    def _p2p(self, group: Any, shape: tuple[int, ...] | None, dtype: torch.dtype) -> PipelineP2P:
        """The step's point-to-point layer (slices under ``scatter_gather_tensors``)."""
        if not self.scatter_gather_tensors:
            return PipelineP2P(group, tensor_shape=shape, tensor_dtype=dtype)
        return ScatterGatherP2P(
            group,
            tp_group=gpc.get_group(ParallelMode.PARALLEL_1D),
            tp_rank=gpc.get_local_rank(ParallelMode.PARALLEL_1D),
            tp_size=gpc.get_world_size(ParallelMode.PARALLEL_1D),
            tensor_shape=shape,
            tensor_dtype=dtype,
        )

    def _set_chunk(self, chunk: int) -> None:
        """Hook before each chunk's forward (the interleaved schedule sets gpc's virtual rank)."""

    # --- one step -----------------------------------------------------------------------------
    def forward_backward_step(
        self,
        engine: Engine,
        data_iter: Iterator[Any] | None,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> StepResult:
        """Run one step of the schedule over the next batch of ``data_iter`` (forward and
        backward of every micro-batch; forwards only with ``forward_only``).

        Every rank of the pipeline calls it with the same batch. Gradients accumulate in
        ``.grad``; ``engine.step()`` runs the gradient handlers and the optimizer.

        Returns:
            On the last stage ``(output, label, loss)``: output and label joined over the
            micro-batches (``None`` without ``return_output_label``), loss the sum of the
            micro-batch losses divided by ``num_microbatches``, a 1-element tensor (``None``
            without ``return_loss``). ``(None, None, None)`` on the other stages.

        Raises:
            ValueError: ``return_loss=False`` while training, or a batch whose size is not a
                multiple of ``num_microbatches`` (both before any communication).
        """
        if not forward_only and not return_loss:
            raise ValueError("return_loss=False needs forward_only=True: backward needs the loss.")
        chunks = self.chunks_of(engine)
        batch = self.load_batch(data_iter)
        micro = split_micro_batches(batch, self.batch_size, self.num_microbatches)
        size, position, ranks, group = self._pipeline()
        table = self._table(size, forward_only)
        # a fresh shape cache each step: shapes are sent once per step (as upstream), so the
        # batch may change size between steps (the last batch of an epoch, eval batches)
        shape = None if self.tensor_shape is None else tuple(self.tensor_shape)
        dtype = self.dtype or activation_dtype(chunks[0])
        p2p = self._p2p(group, shape, dtype)
        options = StepOptions(
            num_microbatches=self.num_microbatches,
            forward_only=forward_only,
            return_loss=return_loss,
            keep_outputs=return_output_label,
            data_func=self._stage_func,
            on_chunk=self._set_chunk,
        )
        executor = LegacyStepExecutor(table, position, ranks, p2p, chunks, engine, micro,
                                      options)  # fmt: skip
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            executor.run(keep_outputs=return_output_label)  # SYNC POINT: stage-to-stage p2p
        self.last_p2p_stats = p2p.stats
        if position != size - 1:
            return None, None, None
        loss = torch.stack(executor.losses).sum().reshape(1) if return_loss else None
        if not return_output_label:
            return None, None, loss
        order = range(self.num_microbatches)
        output = merge_micro([executor.outputs[i] for i in order])
        label = merge_micro([executor.labels[i] for i in order])
        return output, label, loss
