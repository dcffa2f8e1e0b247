"""Colossal-AI's ``colossalai.shardformer.layer.utils``: :class:`Randomizer` (a private random
stream entered with :meth:`Randomizer.fork_rng`), the process-wide randomizer index,
:func:`create_randomizer_with_offset`, and :class:`SeqParallelUtils` (the sequence-parallel
gradient marks, here kolossos' :func:`~kolossos.nn.layer.parallel_1d.mark_sequence_parallel`).

kolossos' own tensor-parallel layers draw their dropout masks from
:mod:`kolossos.nn.layer.parallel_1d.random` instead, so building one neither reads nor advances
the randomizer index; these are for code written against Colossal-AI that uses them directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from kolossos.accelerator import get_accelerator
from kolossos.nn.layer.parallel_1d import (
    all_reduce_sequence_parallel_grads,
    is_sequence_parallel,
    mark_sequence_parallel,
)

__all__ = ["Randomizer", "SeqParallelUtils", "create_randomizer_with_offset"]


def _device_rng() -> bool:
    """Whether the accelerator has a generator of its own (not the CPU generator)."""
    return get_accelerator().name != "cpu"


class Randomizer:
    """A random stream of its own, seeded once, that a block of code runs on.

    ``with randomizer.fork_rng():`` swaps the accelerator generator (and with
    ``enable_cpu=True`` also the CPU generator) for the randomizer's state, runs the block, keeps
    the advanced state for the next fork and puts the caller's state back. On a CPU-only machine
    the accelerator generator *is* the CPU generator, so it is always forked.

    Args:
        seed: the stream's seed.

    Example:
        >>> randomizer = Randomizer(seed=1024 + Randomizer.index())
        >>> with randomizer.fork_rng(enable_cpu=True):
        ...     mask = torch.rand(4) > 0.5
    """

    _INDEX = 0

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.cpu_rng_state = torch.Generator().manual_seed(seed).get_state()
        self._device_state: torch.Tensor | None = None
        if _device_rng():
            accelerator = get_accelerator()
            original = accelerator.get_rng_state()
            accelerator.manual_seed(seed)
            self._device_state = accelerator.get_rng_state()
            accelerator.set_rng_state(original)

    @property
    def device_rng_state(self) -> torch.Tensor:
        """The stream's accelerator generator state (the CPU state on a CPU-only machine)."""
        return self.cpu_rng_state if self._device_state is None else self._device_state

    @property
    def cuda_rng_state(self) -> torch.Tensor:
        """Colossal-AI 0.3.4's name of :attr:`device_rng_state`."""
        return self.device_rng_state

    @contextmanager
    def fork_rng(self, enable_cpu: bool = False) -> Iterator[None]:
        """Run the block on this stream (see the class docstring)."""
        accelerator = get_accelerator()
        fork_cpu = enable_cpu or self._device_state is None
        saved_device = None if self._device_state is None else accelerator.get_rng_state()
        saved_cpu = torch.get_rng_state() if fork_cpu else None
        try:
            if self._device_state is not None:
                accelerator.set_rng_state(self._device_state)
            if fork_cpu:
                torch.set_rng_state(self.cpu_rng_state)
            yield
        finally:
            if saved_device is not None:
                self._device_state = accelerator.get_rng_state()
                accelerator.set_rng_state(saved_device)
            if saved_cpu is not None:
                self.cpu_rng_state = torch.get_rng_state()
                torch.set_rng_state(saved_cpu)

    @staticmethod
    def index() -> int:
        """The process-wide randomizer index (an offset giving each randomizer its own seed)."""
        return Randomizer._INDEX

    @staticmethod
    def increment_index() -> None:
        """Advance the index by one."""
        Randomizer._INDEX += 1

    @staticmethod
    def reset_index() -> None:
        """Set the index back to zero."""
        Randomizer._INDEX = 0

    @staticmethod
    def _extremes(process_group: ProcessGroup | None) -> tuple[int, int]:
        """``(max, min)`` of the index over ``process_group``. COLLECTIVE."""
        index = Randomizer.index()
        device = get_accelerator().get_current_device()
        both = torch.tensor([index, -index], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=process_group)  # SYNC POINT
        return int(both[0]), -int(both[1])

    @staticmethod
    def is_randomizer_index_synchronized(process_group: ProcessGroup | None = None) -> bool:
        """Whether every rank of ``process_group`` has the same index (``True`` without
        torch.distributed). COLLECTIVE over ``process_group``."""
        if not dist.is_initialized():
            return True
        high, low = Randomizer._extremes(process_group)
        return high == low

    @staticmethod
    def synchronize_index(process_group: ProcessGroup | None = None) -> None:
        """Set the index of every rank of ``process_group`` to the largest one. COLLECTIVE."""
        if dist.is_initialized():
            Randomizer._INDEX = Randomizer._extremes(process_group)[0]


def create_randomizer_with_offset(
    seed: int,
    process_group: ProcessGroup | None = None,
    offset_by_rank: bool = True,
    offset_by_index: bool = True,
) -> Randomizer:
    """A :class:`Randomizer` seeded ``seed`` + this rank's rank in ``process_group`` (when
    ``offset_by_rank``) + the randomizer index (when ``offset_by_index``, which then advances the
    index). COLLECTIVE over ``process_group`` when ``offset_by_index`` (the index is checked to
    agree across ranks).

    Raises:
        RuntimeError: ``offset_by_index`` and the ranks' indices differ.
    """
    base_seed = seed
    if offset_by_rank and dist.is_initialized():
        base_seed += dist.get_rank(process_group)
    if offset_by_index:
        if not Randomizer.is_randomizer_index_synchronized(process_group):
            raise RuntimeError(
                "create_randomizer_with_offset: the randomizer index differs across the ranks "
                "of the group; call Randomizer.synchronize_index(group) first."
            )
        base_seed += Randomizer.index()
        Randomizer.increment_index()
    return Randomizer(seed=base_seed)


class SeqParallelUtils:
    """Colossal-AI's helpers for parameters whose gradients sequence parallelism leaves partial
    (norm weights on sequence shards), on kolossos' sequence-parallel marks."""

    @staticmethod
    def marked_as_sp_partial_derived_param(param: torch.Tensor) -> None:
        """Mark ``param``: its gradient must be summed over the tensor-parallel group."""
        mark_sequence_parallel(param)

    @staticmethod
    def is_sp_partial_derived_param(param: torch.Tensor) -> bool:
        """Whether ``param`` is marked."""
        return is_sequence_parallel(param)

    @staticmethod
    def allreduce_partial_data_grad(
        tp_group: ProcessGroup | None,
        model: nn.Module | None = None,
        grads: list[torch.Tensor] | None = None,
    ) -> None:
        """Sum over ``tp_group`` the gradients of ``model``'s marked parameters, or ``grads``
        (exactly one of the two). Nothing happens when ``tp_group`` is ``None`` or has one rank.
        COLLECTIVE over ``tp_group``.

        Raises:
            ValueError: both or neither of ``model`` and ``grads`` given.
        """
        if (model is None) == (grads is None):
            raise ValueError(
                "SeqParallelUtils.allreduce_partial_data_grad: pass exactly one of model= and "
                "grads=."
            )
        if tp_group is None or dist.get_world_size(tp_group) == 1:
            return
        if model is not None:
            all_reduce_sequence_parallel_grads(model, tp_group)
            return
        assert grads is not None
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)  # SYNC POINT
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
