"""Tensor-parallel embeddings: split over the vocabulary (:class:`VocabParallelEmbedding1D`) or
over the embedding dimension (:class:`Embedding1D`)."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d._base import (
    GroupArg,
    ParallelModule1D,
    check_seq_parallel_mode,
    reject_positional,
    to_factory,
    trainable,
)
from kolossos.nn.layer.parallel_1d._comm import (
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_seq_gather_grad,
)
from kolossos.nn.layer.parallel_1d._vocab import vocab_shard
from kolossos.nn.layer.parallel_1d.initializers import (
    Initializer,
    apply_initializer,
    check_initializers,
)

__all__ = ["Embedding1D", "VocabParallelEmbedding1D"]


def _native_embedding(module: nn.Module) -> nn.Embedding:
    if not isinstance(module, nn.Embedding):
        raise TypeError(f"expected an nn.Embedding, got {type(module).__name__}.")
    unsupported = {"max_norm": module.max_norm, "sparse": module.sparse or None}
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(
                f"nn.Embedding({name}={value!r}) has no tensor-parallel version; build the "
                f"embedding without {name}."
            )
    return module


_EMBEDDING_OPTIONS = ("max_norm", "norm_type", "scale_grad_by_freq", "sparse")
"""``F.embedding``'s options after ``padding_idx``, in order (Colossal-AI's ``*args``)."""


def _embedding_options(
    owner: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, freq_ok: bool
) -> bool:
    """Validate ``F.embedding``'s options given as Colossal-AI's ``*args, **kwargs``; returns
    ``scale_grad_by_freq``.

    Raises:
        TypeError: unknown or repeated options.
        NotImplementedError: ``max_norm`` (renormalising a shard would use a partial norm),
            ``sparse``, or ``scale_grad_by_freq`` where ranks do not see every id's count.
    """
    if len(args) > len(_EMBEDDING_OPTIONS):
        raise TypeError(f"{owner}: too many positional options {args!r}.")
    options = dict(zip(_EMBEDDING_OPTIONS, args, strict=False))
    for name, value in kwargs.items():
        if name not in _EMBEDDING_OPTIONS or name in options:
            raise TypeError(
                f"{owner}: unexpected or repeated option {name}={value!r}; F.embedding's options "
                f"are {_EMBEDDING_OPTIONS}."
            )
        options[name] = value
    if options.get("max_norm") is not None:
        raise NotImplementedError(
            f"{owner}: max_norm={options['max_norm']!r} is not supported (each rank would "
            "renormalise with a partial norm); build the embedding without max_norm."
        )
    if options.get("sparse"):
        raise NotImplementedError(f"{owner}: sparse=True is not supported; use dense gradients.")
    freq = bool(options.get("scale_grad_by_freq", False))
    if freq and not freq_ok:
        raise NotImplementedError(
            f"{owner}: scale_grad_by_freq=True is not supported (ids outside a rank's rows are "
            "counted as row 0); drop it."
        )
    return freq


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
        cls: type[_E], module: nn.Module, process_group: GroupArg = None, *args: Any, **kwargs: Any
    ) -> _E:
        """Build from an ``nn.Embedding``, slicing its weight.

        Args:
            module: the embedding to shard (left unchanged).
            process_group: the tensor-parallel group (or a one-element list of it).
            args: not accepted (pass options by keyword).
            kwargs: the constructor's keyword arguments (:class:`VocabParallelEmbedding1D`:
                ``make_vocab_size_divisible_by``, ``seq_parallel_mode``, ``seq_dim``;
                :class:`Embedding1D`: ``gather_output``; both: ``dtype``, ``device``).
        """
        reject_positional(cls.__name__, args)
        emb = _native_embedding(module)
        if emb.scale_grad_by_freq:
            kwargs.setdefault("scale_grad_by_freq", True)
        return cls(
            emb.num_embeddings,
            emb.embedding_dim,
            emb.padding_idx,
            process_group=process_group,
            weight=emb.weight,
            **kwargs,
        )


class VocabParallelEmbedding1D(_Embedding1D):
    """Embedding with the vocabulary rows split over the tensor-parallel group.

    Each rank looks up the ids in its row range (others give zeros) and the partial embeddings
    are summed (all-reduce; reduce-scatter along ``seq_dim`` under sequence parallelism, which
    leaves each rank its sequence shard). The vocabulary is padded with zero rows to a multiple
    of ``make_vocab_size_divisible_by * tp_size``; ids must lie in ``[0, num_embeddings)``.
    The positional order is Colossal-AI's; kolossos' own options are keyword-only.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: embedding size.
        padding_idx: as in ``nn.Embedding`` (its row gets no gradient).
        dtype: dtype of the weight (a given weight is cast to it).
        device: where the weight lives (a given weight is moved there).
        process_group: the tensor-parallel group (default: the world).
        weight: the full ``(num_embeddings, embedding_dim)`` weight to shard.
        weight_initializer: ``init(shard, fan_in=num_embeddings, fan_out=embedding_dim)``
            filling this rank's rows (per-rank random stream; padding rows stay zero); only
            when ``weight`` is not given. Default: ``nn.Embedding``'s initialisation.
        args: ``F.embedding``'s options after ``padding_idx`` (``max_norm``, ``norm_type``,
            ``scale_grad_by_freq``, ``sparse``), as in Colossal-AI: ``max_norm``, ``sparse`` and
            ``scale_grad_by_freq`` raise ``NotImplementedError``.
        make_vocab_size_divisible_by: padding granularity per rank (Megatron's default 64; 1
            for Colossal-AI's layout, which needs a vocabulary divisible by the group size).
        seq_parallel_mode: ``"split_gather"`` to reduce-scatter the output along ``seq_dim``.
        seq_dim: the sequence dimension of the output.
        kwargs: ``F.embedding``'s options by name.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: GroupArg = None,
        weight: torch.Tensor | None = None,
        weight_initializer: Initializer | None = None,
        *args: Any,
        make_vocab_size_divisible_by: int = 64,
        seq_parallel_mode: str | None = None,
        seq_dim: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        _embedding_options(name, args, kwargs, freq_ok=False)
        check_initializers(name, weight is not None, weight_initializer=weight_initializer)
        self.seq_parallel_mode = check_seq_parallel_mode(seq_parallel_mode)
        self.seq_dim = seq_dim
        self._init_group(process_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.num_embeddings_padded, self.vocab_start, self.vocab_end = vocab_shard(
            num_embeddings, self.tp_rank, self.tp_size, make_vocab_size_divisible_by
        )
        local_pad = None
        if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end:
            local_pad = padding_idx - self.vocab_start
        self._local_padding_idx = local_pad
        padded = self.num_embeddings_padded - num_embeddings
        if weight_initializer is None:
            given = to_factory(weight, device, dtype)
            full = _full_weight(given, num_embeddings, embedding_dim, padding_idx, device, dtype)
            self.weight = self._shard_param(full, 0, padded=padded, requires_grad=trainable(full))
            return
        shape = (num_embeddings, embedding_dim)
        self.weight = self._empty_shard(shape, 0, device=device, dtype=dtype, padded=padded)
        apply_initializer(
            self.weight,
            weight_initializer,
            self.process_group,
            sharded=True,
            fan_in=num_embeddings,
            fan_out=embedding_dim,
        )
        with torch.no_grad():  # vocabulary padding and the padding row stay zero
            self.weight[max(0, num_embeddings - self.vocab_start) :].zero_()
            if local_pad is not None:
                self.weight[local_pad].zero_()

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
    all-gathered along its last dimension unless ``gather_output=False``. The positional order
    is Colossal-AI's.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: embedding size (divisible by the group size).
        padding_idx: as in ``nn.Embedding``.
        dtype: dtype of the weight (a given weight is cast to it).
        device: where the weight lives (a given weight is moved there).
        process_group: the tensor-parallel group (default: the world).
        gather_output: all-gather the embedding dimension.
        weight: the full weight to shard.
        weight_initializer: ``init(shard, fan_in=num_embeddings, fan_out=embedding_dim)``
            filling this rank's columns (per-rank random stream; the padding row is zeroed);
            only when ``weight`` is not given. Default: ``nn.Embedding``'s initialisation.
        args: ``F.embedding``'s options after ``padding_idx``; ``scale_grad_by_freq`` is
            supported (every rank sees all ids), ``max_norm`` and ``sparse`` raise
            ``NotImplementedError``.
        kwargs: the same options by name.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: GroupArg = None,
        gather_output: bool = True,
        weight: torch.Tensor | None = None,
        weight_initializer: Initializer | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.scale_grad_by_freq = _embedding_options(name, args, kwargs, freq_ok=True)
        check_initializers(name, weight is not None, weight_initializer=weight_initializer)
        self._init_group(process_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.gather_output = padding_idx, gather_output
        if weight_initializer is None:
            given = to_factory(weight, device, dtype)
            full = _full_weight(given, num_embeddings, embedding_dim, padding_idx, device, dtype)
            self.weight = self._shard_param(full, 1, requires_grad=trainable(full))
            return
        shape = (num_embeddings, embedding_dim)
        self.weight = self._empty_shard(shape, 1, device=device, dtype=dtype)
        apply_initializer(
            self.weight,
            weight_initializer,
            self.process_group,
            sharded=True,
            fan_in=num_embeddings,
            fan_out=embedding_dim,
        )
        if padding_idx is not None:
            with torch.no_grad():
                self.weight[padding_idx].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(
            input_ids, self.weight, self.padding_idx, scale_grad_by_freq=self.scale_grad_by_freq
        )
        if self.gather_output:
            out = gather_from_tp(out, self.process_group, dim=-1)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp_size={self.tp_size}"
