"""``ShardConfig``: what :class:`~kolossos.shardformer.ShardFormer` does to a model, validated."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["SEQUENCE_PARALLELISM_MODES", "ShardConfig"]

SEQUENCE_PARALLELISM_MODES = ("split_gather",)
"""Sequence-parallel modes ShardFormer implements (Megatron sequence parallelism)."""

_OTHER_MODES = ("all_to_all", "ring", "ring_attn")
"""Colossal-AI's attention-level modes: recognised, not implemented."""


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """How to shard a model over a tensor-parallel group.

    Example:
        >>> cfg = ShardConfig(tensor_parallel_process_group=tp_group,  # doctest: +SKIP
        ...                   enable_sequence_parallelism=True)
        >>> model, shared = ShardFormer(cfg).optimize(model)  # doctest: +SKIP
    """

    tensor_parallel_process_group: ProcessGroup | None = None
    """Ranks the weights are split over; ``None``: the default (world) group."""
    enable_tensor_parallelism: bool = True
    """Replace the plan's layers by tensor-parallel ones. ``False``: the model is left unsharded
    (``optimize`` still reports its tied weights)."""
    enable_sequence_parallelism: bool = False
    """Megatron sequence parallelism: between tensor-parallel regions the hidden states are split
    along the sequence over the group (needs ``enable_tensor_parallelism``)."""
    sequence_parallelism_mode: str = "split_gather"
    """Only ``'split_gather'`` (all-gather into the column layers, reduce-scatter out of the row
    layers). Read only when ``enable_sequence_parallelism`` is set."""
    enable_all_optimization: bool = False
    """Colossal-AI's fused kernels (fused norms, flash attention, JIT ops): not implemented, so
    ``True`` raises ``NotImplementedError``."""
    parallel_output: bool = True
    """``True``: the LM head's logits stay split over the vocabulary and a loss requested with
    ``labels`` is a vocabulary-parallel cross-entropy (full logits are never built). ``False``:
    the logits are gathered to the full vocabulary and the model's own loss runs unchanged."""
    make_vocab_size_divisible_by: int = 64
    """The vocabulary of sharded embeddings and LM heads is padded to a multiple of this times
    the tensor-parallel size (padding rows are masked out of the loss and stripped on gather)."""

    def __post_init__(self) -> None:
        for name in (
            "enable_tensor_parallelism",
            "enable_sequence_parallelism",
            "enable_all_optimization",
            "parallel_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ShardConfig.{name}={getattr(self, name)!r} must be a bool.")
        if self.enable_all_optimization:
            raise NotImplementedError(
                "ShardConfig(enable_all_optimization=True): kolossos has no fused kernels (fused "
                "normalization, flash attention, JIT ops) in its plans; leave it False "
                "(transformers already uses PyTorch's SDPA attention)."
            )
        self._check_sequence_parallelism()
        size = self.make_vocab_size_divisible_by
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"ShardConfig.make_vocab_size_divisible_by={size!r} must be a positive int "
                "(1: pad the vocabulary only to a multiple of the tensor-parallel size)."
            )

    def _check_sequence_parallelism(self) -> None:
        if not self.enable_sequence_parallelism:
            return
        mode = self.sequence_parallelism_mode
        if mode in _OTHER_MODES:
            raise NotImplementedError(
                f"ShardConfig(sequence_parallelism_mode={mode!r}) is not implemented; use "
                "'split_gather' (Megatron sequence parallelism)."
            )
        if mode not in SEQUENCE_PARALLELISM_MODES:
            raise ValueError(
                f"ShardConfig.sequence_parallelism_mode={mode!r} is unknown; the supported mode "
                f"is {SEQUENCE_PARALLELISM_MODES}."
            )
        if not self.enable_tensor_parallelism:
            raise ValueError(
                "ShardConfig(enable_sequence_parallelism=True) needs enable_tensor_parallelism="
                "True: Megatron sequence parallelism splits the sequence over the tensor-parallel "
                "group between its tensor-parallel regions."
            )

    @property
    def tp_group(self) -> ProcessGroup:
        """The tensor-parallel group (the world group when none was given).

        Raises:
            RuntimeError: torch.distributed is not initialised.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "ShardFormer needs torch.distributed: call kolossos.launch(...) (or "
                "torch.distributed.init_process_group) before sharding a model."
            )
        group = self.tensor_parallel_process_group
        if group is None:
            group = dist.group.WORLD
        assert group is not None
        return group

    @property
    def tp_size(self) -> int:
        """Number of ranks in :attr:`tp_group` (1 when tensor parallelism is disabled)."""
        if not self.enable_tensor_parallelism:
            return 1
        return dist.get_world_size(self.tp_group)

    @property
    def sequence_parallel(self) -> bool:
        """Whether Megatron sequence parallelism is on."""
        return self.enable_sequence_parallelism
