"""Language-model head with the vocabulary split over the tensor-parallel group.

The head is a column-parallel linear layer over a (padded) vocabulary. By default it returns
each rank's logits only; :meth:`VocabParallelLMHead1D.loss` (or
:func:`~kolossos.nn.layer.parallel_1d.cross_entropy.vocab_parallel_cross_entropy`) turns them into
the cross-entropy without ever building the ``(tokens, vocab)`` logits on one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._base import ParallelModule1D, check_seq_parallel_mode, trainable
from kolossos.nn.layer.parallel_1d._comm import (
    copy_to_tp,
    gather_from_tp,
    gather_seq_reduce_scatter_grad,
)
from kolossos.nn.layer.parallel_1d._vocab import vocab_shard
from kolossos.nn.layer.parallel_1d.cross_entropy import vocab_parallel_cross_entropy

__all__ = ["VocabParallelLMHead1D"]


class VocabParallelLMHead1D(ParallelModule1D):
    """``nn.Linear(hidden, vocab)`` with the vocabulary rows split (and zero-padded like
    :class:`~kolossos.nn.layer.parallel_1d.embedding.VocabParallelEmbedding1D`, so the two can
    share one weight).

    Args:
        in_features: hidden size.
        out_features: vocabulary size.
        bias: whether the head has a bias.
        device: where to create the weights when ``weight`` is not given.
        dtype: their dtype.
        process_group: the tensor-parallel group (default: the world).
        gather_output: return the full ``(..., vocab)`` logits (padding stripped) instead of this
            rank's ``(..., V_local)`` slice.
        make_vocab_size_divisible_by: padding granularity per rank (Megatron's default 64).
        seq_parallel_mode: ``"split_gather"``: the input is a sequence shard, all-gathered first.
        seq_dim: the sequence dimension of the input.
        weight: the full ``(vocab, hidden)`` weight to shard.
        bias_: the full bias.

    Example:
        >>> head = VocabParallelLMHead1D.from_native_module(model.lm_head, group)  # doctest: +SKIP
        >>> loss = head.loss(head(hidden[:, :-1]), input_ids[:, 1:])  # doctest: +SKIP
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        process_group: ProcessGroup | None = None,
        gather_output: bool = False,
        make_vocab_size_divisible_by: int = 64,
        seq_parallel_mode: str | None = None,
        seq_dim: int = 1,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.seq_parallel_mode = check_seq_parallel_mode(seq_parallel_mode)
        self.seq_dim, self.gather_output = seq_dim, gather_output
        self._init_group(process_group)
        self.in_features, self.out_features = in_features, out_features
        self.vocab_size = out_features
        self.out_features_padded, self.vocab_start, self.vocab_end = vocab_shard(
            out_features, self.tp_rank, self.tp_size, make_vocab_size_divisible_by
        )
        if weight is None:
            dense = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
            weight, bias_ = dense.weight.detach(), None if dense.bias is None else dense.bias
        padded = self.out_features_padded - out_features
        self.weight = self._shard_param(weight, 0, padded=padded, requires_grad=trainable(weight))
        if bias and bias_ is None:
            bias_ = torch.zeros(out_features, device=weight.device, dtype=weight.dtype)
        if bias_ is not None:
            self.bias = self._shard_param(bias_, 0, padded=padded, requires_grad=trainable(bias_))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group: ProcessGroup | None = None, **options: Any
    ) -> VocabParallelLMHead1D:
        """Build from an ``nn.Linear`` head, slicing its rows (``options``: ``gather_output``,
        ``make_vocab_size_divisible_by``, ``seq_parallel_mode``, ``seq_dim``)."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"expected an nn.Linear LM head, got {type(module).__name__}.")
        return cls(
            module.in_features,
            module.out_features,
            module.bias is not None,
            process_group=process_group,
            weight=module.weight,
            bias_=module.bias,
            **options,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seq_parallel_mode is not None:
            x = gather_seq_reduce_scatter_grad(x, self.process_group, self.seq_dim)
        else:
            x = copy_to_tp(x, self.process_group)
        logits = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            full = gather_from_tp(logits, self.process_group, dim=-1)
            return full[..., : self.vocab_size]
        return logits

    def loss(
        self,
        local_logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Cross-entropy of this head's local logits (``gather_output=False``) against
        ``labels``, as ``F.cross_entropy`` on the full logits would give. COLLECTIVE."""
        if self.gather_output:
            raise ValueError(
                "VocabParallelLMHead1D.loss needs the local logits; build the head with "
                "gather_output=False, or use F.cross_entropy on the gathered logits."
            )
        return vocab_parallel_cross_entropy(
            local_logits,
            labels,
            self.process_group,
            vocab_size=self.vocab_size,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction=reduction,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, vocab={self.vocab_size}, "
            f"padded={self.out_features_padded}, rows=[{self.vocab_start}, {self.vocab_end}), "
            f"tp_size={self.tp_size}"
        )
