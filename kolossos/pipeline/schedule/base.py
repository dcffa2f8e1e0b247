"""``PipelineSchedule``: the runner a plugin calls once per training step.

A schedule is a registered :class:`~kolossos.pipeline.schedule.registry.ScheduleSpec` (its table
builder, a pure function, plus its chunk rules and layout) run by the shared executor. This class
runs any registered schedule by name; the named subclasses (``GPipeSchedule``, ...) only set
``name`` (and add options such as ZB-V's ``costs``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from kolossos.interface.optimizer import OptimizerWrapper
from kolossos.pipeline.p2p import PipelineP2P
from kolossos.pipeline.schedule.executor import ScheduleExecutor, StepStats
from kolossos.pipeline.schedule.microbatch import merge_outputs, split_batch
from kolossos.pipeline.schedule.registry import (
    ScheduleSpec,
    check_num_chunks,
    schedule_names,
    schedule_spec,
)
from kolossos.pipeline.schedule.registry import build_table as registered_table
from kolossos.pipeline.schedule.simulation import simulate
from kolossos.pipeline.schedule.table import ScheduleTable, validate_table
from kolossos.pipeline.shared import stash_shared_gradients, sync_shared_gradients
from kolossos.pipeline.stage_manager import PipelineStageManager


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """How a step is cut into micro-batches and how stages exchange tensors."""

    num_microbatches: int | None = None
    """micro-batches per step (give this or ``microbatch_size``)"""
    microbatch_size: int | None = None
    """samples per micro-batch (the count follows from the batch size)"""
    tensor_shape: tuple[int, ...] | None = None
    """fixed shape of every inter-stage activation (the docs' ``TENSOR_SHAPE``): no shape
    exchange at all; ``None`` negotiates shapes"""
    tensor_dtype: torch.dtype = torch.float32
    """dtype of fixed-shape activations"""
    enable_metadata_cache: bool = True
    """exchange each activation stream's shapes once (``False``: with every message, for shapes
    that change between micro-batches)"""

    def __post_init__(self) -> None:
        if (self.num_microbatches is None) == (self.microbatch_size is None):
            raise ValueError(
                f"give exactly one of num_microbatches={self.num_microbatches} and "
                f"microbatch_size={self.microbatch_size}."
            )
        for name in ("num_microbatches", "microbatch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int.")
        if self.tensor_shape is not None and any(d < 1 for d in self.tensor_shape):
            raise ValueError(f"tensor_shape={self.tensor_shape} must have positive sizes.")


_RUNNERS: dict[str, type[PipelineSchedule]] = {}
"""schedule name -> the first subclass of :class:`PipelineSchedule` that declares it"""


class PipelineSchedule:
    """Runs forward and backward of all micro-batches of a step over the pipeline.

    The table, the chunk layout and whether the backward is split come from the registered
    schedule (:mod:`~kolossos.pipeline.schedule.registry`): the class's ``name``, or ``schedule``
    for this class itself. A subclass that declares ``name`` is what
    :func:`~kolossos.pipeline.schedule.create_schedule` builds for that schedule (the first one
    defined); a subclass without a name overrides :meth:`build_table` and sets ``layout``.

    Args:
        stage_manager: this rank's place in the pipeline (its chunk count and layout must suit
            the schedule).
        num_microbatches: micro-batches per step (or ``microbatch_size``).
        microbatch_size: samples per micro-batch.
        tensor_shape: fixed inter-stage activation shape (no shape exchange).
        tensor_dtype: dtype of those activations.
        enable_metadata_cache: exchange shapes once per stream.
        schedule: the registered schedule to run (default: the class's ``name``); for
            ``PipelineSchedule`` itself, e.g. ``PipelineSchedule(manager, 8, schedule="1f1b")``.

    Raises:
        ValueError: an invalid configuration, an unknown schedule, a ``schedule`` other than the
            class's own, or a stage manager whose chunk count or layout the schedule cannot run.
    """

    name: str = ""
    """the registered schedule this class runs (``""``: none, ``build_table`` is overridden)"""
    layout: str = "loop"
    """the chunk layout the stage manager must use (from the registration when there is one)"""
    split_backward: bool = False
    """whether the tables split the backward into ``B`` and ``W`` (from the registration)"""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if isinstance(name, str) and name:
            _RUNNERS.setdefault(name, cls)

    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        *,
        tensor_shape: Sequence[int] | None = None,
        tensor_dtype: torch.dtype = torch.float32,
        enable_metadata_cache: bool = True,
        schedule: str | None = None,
    ) -> None:
        self.config = ScheduleConfig(
            num_microbatches=num_microbatches,
            microbatch_size=microbatch_size,
            tensor_shape=tuple(tensor_shape) if tensor_shape is not None else None,
            tensor_dtype=tensor_dtype,
            enable_metadata_cache=enable_metadata_cache,
        )
        own = type(self).name
        if schedule is not None and own and schedule != own:
            raise ValueError(
                f"{type(self).__name__} runs schedule {own!r}, got schedule={schedule!r}; use "
                f"create_schedule({schedule!r}, ...) or PipelineSchedule(..., schedule=...)."
            )
        name = schedule if schedule is not None else own
        self.spec: ScheduleSpec | None = schedule_spec(name) if name else None
        """the registration this runner follows (``None``: a subclass with its own table)"""
        if self.spec is not None:
            self.name = self.spec.name
            self.layout = self.spec.layout
            self.split_backward = self.spec.split_backward
        self.stage_manager = stage_manager
        self._check_manager()
        self._p2p: PipelineP2P | None = None
        self._tables: dict[int, ScheduleTable] = {}
        self.last_stats: StepStats | None = None
        """the executor's measurements of the latest step on this rank"""

    @property
    def num_model_chunks(self) -> int:
        """Chunks per rank this schedule runs."""
        return self.stage_manager.num_model_chunks

    def _check_manager(self) -> None:
        sm = self.stage_manager
        if sm.layout != self.layout:
            raise ValueError(
                f"{type(self).__name__} places chunks in the {self.layout!r} layout but the stage "
                f"manager uses {sm.layout!r}; create it with layout={self.layout!r}."
            )
        if self.spec is not None:
            check_num_chunks(self.spec.name, sm.num_model_chunks, arg="num_model_chunks")

    def build_table(self, num_microbatches: int) -> ScheduleTable:
        """The schedule's table for ``num_microbatches`` (pure): the registered builder's, for
        this stage manager's size and chunk count.

        Raises:
            NotImplementedError: no registered schedule and no override.
        """
        if self.spec is None:
            raise NotImplementedError(
                f"{type(self).__name__} names no registered schedule; pass schedule=<one of "
                f"{list(schedule_names())}> or override build_table."
            )
        sm = self.stage_manager
        return registered_table(self.spec.name, sm.pp_size, num_microbatches, sm.num_model_chunks)

    def table(self, num_microbatches: int) -> ScheduleTable:
        """The validated table (cached per micro-batch count)."""
        if num_microbatches not in self._tables:
            table = self.build_table(num_microbatches)
            validate_table(table)
            sm = self.stage_manager
            if (table.pp_size, table.num_chunks, table.layout) != (
                sm.pp_size,
                sm.num_model_chunks,
                sm.layout,
            ):
                raise ValueError(
                    f"{table.name} needs {table.num_chunks} chunk(s) on {table.pp_size} ranks in "
                    f"the {table.layout!r} layout; the stage manager has {sm.num_model_chunks} on "
                    f"{sm.pp_size} in {sm.layout!r}: build the stage manager to match."
                )
            self._tables[num_microbatches] = table
        return self._tables[num_microbatches]

    @property
    def takes_chunk_list(self) -> bool:
        """Whether an ``nn.ModuleList`` given to :meth:`forward_backward_step` is the list of
        chunks (schedules that may run several chunks per rank: interleaved, ZB-V) rather than
        one stage module (GPipe, 1F1B, ZB-H1), as in Colossal-AI."""
        if self.spec is not None:
            return self.spec.fixed_chunks != 1
        return self.num_model_chunks > 1

    def _chunks(self, model_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
        chunks: list[nn.Module]
        if isinstance(model_chunks, nn.ModuleList):
            # A single-chunk schedule runs a ModuleList with a forward (its class's or one set
            # on the instance) as the stage; one without a forward can only be a list of chunks.
            one = not self.takes_chunk_list and _has_forward(model_chunks)
            chunks = [model_chunks] if one else list(model_chunks)
        elif isinstance(model_chunks, nn.Module):
            chunks = [model_chunks]
        else:
            chunks = list(model_chunks)
        if len(chunks) != self.num_model_chunks:
            raise ValueError(
                f"{type(self).__name__} runs {self.num_model_chunks} model chunk(s) per rank, got "
                f"{len(chunks)}; pass one module per chunk (an nn.ModuleList for several)."
            )
        return chunks

    def _check_optimizer(self, optimizer: Any) -> None:
        """Split backwards run autograd directly; an optimizer that rewrites the backward (loss
        scaling, gradient partitioning) would be bypassed."""
        if optimizer is None or not self.split_backward:
            return
        kind = type(optimizer)
        plain = isinstance(optimizer, OptimizerWrapper) and (
            kind.backward is OptimizerWrapper.backward
            and kind.backward_by_grad is OptimizerWrapper.backward_by_grad
        )
        if not plain:
            raise NotImplementedError(
                f"{type(self).__name__} splits the backward and cannot route it through "
                f"{kind.__name__}.backward; use the 1f1b or interleaved schedule with this "
                "optimizer, or pass optimizer=None."
            )

    def forward_backward_step(
        self,
        model_chunks: nn.Module | Sequence[nn.Module],
        data_iter: Iterator[Any],
        criterion: Callable[..., torch.Tensor],
        optimizer: Any = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """Forward and backward of one batch from ``data_iter`` over all micro-batches.

        Every rank of the pipeline calls this with its own chunks and the same data (only the
        first stage reads the inputs and only the last the targets). Gradients accumulate in
        ``.grad`` (already divided by the micro-batch count, so a mean-reduced criterion gives
        the full batch's gradient); the caller steps the optimizer.

        Called under ``torch.no_grad()`` (as in Colossal-AI), the step is forward-only: every
        rank runs only its forward actions, in the table's order, no autograd graph is built,
        no ``.grad`` is touched and ``optimizer`` is not used; the loss and outputs are those of
        the training step.

        Args:
            model_chunks: this rank's chunk (a module) or chunks (a list, or an
                ``nn.ModuleList`` when :attr:`takes_chunk_list`; otherwise an ``nn.ModuleList``
                with a ``forward`` is the one stage module).
            data_iter: yields one batch per call (see :mod:`~kolossos.pipeline.schedule.microbatch`
                for the accepted forms).
            criterion: ``criterion(output, target)``, evaluated on the last stage only.
            optimizer: optional wrapper whose ``backward`` / ``backward_by_grad`` run the
                unsplit backward passes.
            return_loss: report the loss (mean over micro-batches) on the last stage.
            return_outputs: report the last stage's outputs, joined along the batch dimension.

        Returns:
            ``{"loss": tensor or None, "outputs": ... or None}``; values only on the rank holding
            the last stage.
        """
        chunks = self._chunks(model_chunks)
        forward_only = not torch.is_grad_enabled()
        if not forward_only:
            self._check_optimizer(optimizer)
        micro = split_batch(next(data_iter), self.config.num_microbatches,
                            self.config.microbatch_size)  # fmt: skip
        table = self.table(len(micro))
        if self._p2p is None:
            self._p2p = PipelineP2P(
                self.stage_manager.group if self.stage_manager.pp_size > 1 else None,
                tensor_shape=self.config.tensor_shape, tensor_dtype=self.config.tensor_dtype,
                enable_metadata_cache=self.config.enable_metadata_cache,
            )  # fmt: skip
        executor = ScheduleExecutor(table, self.stage_manager.stage, self.stage_manager.global_rank,
                                    self._p2p, chunks, criterion, optimizer, micro,
                                    forward_only=forward_only)  # fmt: skip
        if forward_only:
            self.last_stats = executor.run(keep_outputs=return_outputs)
        else:
            earlier = stash_shared_gradients(chunks)  # accumulated earlier: summed already
            self.last_stats = executor.run(keep_outputs=return_outputs)
            sync_shared_gradients(chunks, earlier)
        result: dict[str, Any] = {"loss": None, "outputs": None}
        if executor.losses and return_loss:
            result["loss"] = torch.stack(executor.losses).sum()
        if executor.outputs and return_outputs:
            result["outputs"] = merge_outputs([executor.outputs[i] for i in range(len(micro))])
        return result

    def bubble_bound(self, num_microbatches: int) -> float:
        """The modelled bubble fraction of this schedule's table (``F=1, B=2``, or
        ``F=B=W=1`` when split; free communication)."""
        return simulate(self.table(num_microbatches)).bubble_fraction


def _has_forward(module: nn.Module) -> bool:
    """Whether ``module`` can be called: its class or the instance defines ``forward``."""
    return "forward" in vars(module) or type(module).forward is not nn.Module.forward


def schedule_class(name: str) -> type[PipelineSchedule]:
    """The class that runs registered schedule ``name``: the first subclass declaring that
    ``name``, else :class:`PipelineSchedule` itself (built with ``schedule=name``).

    Raises:
        ValueError: ``name`` is not registered.
    """
    schedule_spec(name)
    return _RUNNERS.get(name, PipelineSchedule)
