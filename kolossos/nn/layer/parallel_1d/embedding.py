"""Tensor-parallel embeddings: split over the vocabulary (:class:`VocabParallelEmbedding1D`) or
over the embedding dimension (:class:`Embedding1D`)."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._base import ParallelModule1D, check_seq_parallel_mode, trainable
from kolossos.nn.layer.parallel_1d._comm import (
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_seq_gather_grad,
)
from kolossos.nn.layer.parallel_1d._vocab import vocab_shard

__all__ = ["Embedding1D", "VocabParallelEmbedding1D"]


def _native_embedding(module: nn.Module) -> nn.Embedding:
    if not isinstance(module, nn.Embedding):
        raise TypeError(f"expected an nn.Embedding, got {type(module).__name__}.")
    unsupported = {
        "max_norm": module.max_norm,
        "scale_grad_by_freq": module.scale_grad_by_freq or None,
        "sparse": module.sparse or None,
    }
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(
                f"nn.Embedding({name}={value!r}) has no tensor-parallel version; build the "
                f"embedding without {name}."
            )
    return module


def _full_weight(
    weight: torch.Tensor | None,
    num_embeddings: int,
    embedding_dim: int,
    padding_idx: int | None,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """``weight``, or one initialised as ``nn.Embedding`` would (same random draws)."""
    if weight is None:
        dense = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
        weight = dense.weight.detach()
    if tuple(weight.shape) != (num_embeddings, embedding_dim):
        raise ValueError(
            f"embedding weight of shape {tuple(weight.shape)} does not match "
            f"({num_embeddings}, {embedding_dim})."
        )
    return weight


_E = TypeVar("_E", bound="_Embedding1D")


class _Embedding1D(ParallelModule1D):
    """Shared construction of the two embeddings from an ``nn.Embedding``."""

    @classmethod
    def from_native_module(
        cls: type[_E], module: nn.Module, process_group: ProcessGroup | None = None, **options: Any
    ) -> _E:
        """Build from an ``nn.Embedding``, slicing its weight (``options``: the constructor's
        keyword arguments; :class:`VocabParallelEmbedding1D`: ``make_vocab_size_divisible_by``,
        ``seq_parallel_mode``, ``seq_dim``; :class:`Embedding1D`: ``gather_output``)."""
        emb = _native_embedding(module)
        return cls(
            emb.num_embeddings,
            emb.embedding_dim,
            emb.padding_idx,
            process_group=process_group,
            weight=emb.weight,
            **options,
        )


class VocabParallelEmbedding1D(_Embedding1D):
    """Embedding with the vocabulary rows split over the tensor-parallel group.

    Each rank looks up the ids in its row range (others give zeros) and the partial embeddings
    are summed (all-reduce; reduce-scatter along ``seq_dim`` under sequence parallelism, which
    leaves each rank its sequence shard). The vocabulary is padded with zero rows to a multiple
    of ``make_vocab_size_divisible_by * tp_size``; ids must lie in ``[0, num_embeddings)``.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: embedding size.
        padding_idx: as in ``nn.Embedding`` (its row gets no gradient).
        device: where to create the weight when ``weight`` is not given.
        dtype: its dtype.
        process_group: the tensor-parallel group (default: the world).
        make_vocab_size_divisible_by: padding granularity per rank (Megatron's default 64).
        seq_parallel_mode: ``"split_gather"`` to reduce-scatter the output along ``seq_dim``.
        seq_dim: the sequence dimension of the output.
        weight: the full ``(num_embeddings, embedding_dim)`` weight to shard.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        process_group: ProcessGroup | None = None,
        make_vocab_size_divisible_by: int = 64,
        seq_parallel_mode: str | None = None,
        seq_dim: int = 1,
        weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.seq_parallel_mode = check_seq_parallel_mode(seq_parallel_mode)
        self.seq_dim = seq_dim
        self._init_group(process_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.num_embeddings_padded, self.vocab_start, self.vocab_end = vocab_shard(
            num_embeddings, self.tp_rank, self.tp_size, make_vocab_size_divisible_by
        )
        full = _full_weight(weight, num_embeddings, embedding_dim, padding_idx, device, dtype)
        self.weight = self._shard_param(
            full,
            0,
            padded=self.num_embeddings_padded - num_embeddings,
            requires_grad=trainable(full),
        )
        local_pad = None
        if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end:
            local_pad = padding_idx - self.vocab_start
        self._local_padding_idx = local_pad

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.seq_parallel_mode is not None:
            return reduce_scatter_seq_gather_grad(out, self.process_group, self.seq_dim)
        return reduce_from_tp(out, self.process_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padded={self.num_embeddings_padded}, "
            f"rows=[{self.vocab_start}, {self.vocab_end}), tp_size={self.tp_size}"
        )


class Embedding1D(_Embedding1D):
    """Embedding with the embedding dimension split over the tensor-parallel group; the output is
    all-gathered along its last dimension unless ``gather_output=False``.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: embedding size (divisible by the group size).
        padding_idx: as in ``nn.Embedding``.
        device: where to create the weight when ``weight`` is not given.
        dtype: its dtype.
        process_group: the tensor-parallel group (default: the world).
        gather_output: all-gather the embedding dimension.
        weight: the full weight to shard.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        process_group: ProcessGroup | None = None,
        gather_output: bool = True,
        weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self._init_group(process_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.gather_output = padding_idx, gather_output
        full = _full_weight(weight, num_embeddings, embedding_dim, padding_idx, device, dtype)
        self.weight = self._shard_param(full, 1, requires_grad=trainable(full))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids, self.weight, self.padding_idx)
        if self.gather_output:
            out = gather_from_tp(out, self.process_group, dim=-1)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp_size={self.tp_size}"
