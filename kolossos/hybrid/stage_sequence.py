"""Megatron sequence parallelism (``sequence_parallelism_mode='split_gather'``) across pipeline
stages.

Without a pipeline the ShardFormer plan splits the hidden states along the sequence over the TP
group at the input of the model's first block and gathers them at the output of the plan's
``gather_after`` module (the final norm or the last block). Those hooks sit on modules the stage
chunks share, so under ``pp_size > 1`` the first stage scatters (its first block is the model's)
and the last stage gathers before the head and the loss; every block in between, and so every
stage boundary, sees the rank's ``(micro-batch, S / tp, H)`` shard: the stages send the shard,
``1 / tp`` of the full hidden state.

A later stage still runs the model's own ``forward`` (see :mod:`kolossos.shardformer.pipeline`):
its hollow embeddings return zeros shaped like the received activation, from which the model
builds the causal / padding mask, ``position_ids`` and the rotary tables. Those must cover the
whole sequence (the attention inside a block runs on it, gathered by the TP region's entry), so
:func:`install_stage_sequence_shards` hands the stage a zero placeholder of the full shape and
swaps the received shard back in at the input of the stage's first block (a pre-hook running
after the pipeline's own injection). The shard is the tensor the schedule received, so its
gradient goes back to the previous stage unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kolossos.shardformer.pipeline import stage_of

__all__ = ["install_stage_sequence_shards"]


class _ShardedStageInput:
    """The call of a non-first stage chunk whose received hidden state is a sequence shard."""

    def __init__(self, runner: Callable[..., Any], tp_size: int, seq_dim: int) -> None:
        self.runner, self.tp_size, self.seq_dim = runner, tp_size, seq_dim
        self.shard: torch.Tensor | None = None
        """the received shard while the chunk's forward runs"""

    def __call__(self, hidden: torch.Tensor, *carried: Any, **kwargs: Any) -> Any:
        shape = list(hidden.shape)
        shape[self.seq_dim] *= self.tp_size
        # masks, positions and rotary tables are built from the placeholder: the whole sequence
        placeholder = hidden.new_zeros(shape)
        self.shard = hidden
        try:
            return self.runner(placeholder, *carried, **kwargs)
        finally:
            self.shard = None

    def swap(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Pre-hook of the stage's first block: its input is the received shard."""
        if self.shard is None:
            return None
        if args:
            return (self.shard, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.shard}


def install_stage_sequence_shards(
    chunks: nn.ModuleList, blocks: nn.ModuleList, tp_size: int, seq_dim: int = 1
) -> int:
    """Let this rank's non-first stage ``chunks`` take a ``(micro-batch, S / tp_size, H)``
    sequence shard from the previous stage (module doc). Call right after the chunks are cut
    (the swap must run after the pipeline's own injection hook). No communication.

    Args:
        chunks: the chunks of :func:`~kolossos.shardformer.pipeline.build_stage_chunk`.
        blocks: the whole model's blocks (the chunks' first blocks are found among them).
        tp_size: the tensor-parallel size the sequence is split over.
        seq_dim: the sequence dimension of the hidden states.

    Returns:
        The number of chunks changed.

    Raises:
        TypeError: a chunk not built by ``build_stage_chunk``.
    """
    changed = 0
    for chunk in chunks:
        stage = stage_of(chunk)
        if stage is None:
            raise TypeError(f"{type(chunk).__name__} is not a pipeline stage chunk.")
        if stage.first:
            continue  # its first block is the model's: the plan's split hook scatters there
        shard_input = _ShardedStageInput(chunk.forward, tp_size, seq_dim)
        blocks[stage.start].register_forward_pre_hook(shard_input.swap, with_kwargs=True)
        object.__setattr__(chunk, "forward", shard_input)
        changed += 1
    return changed
