"""transformers' causal-LM loss, computed from vocabulary-parallel logits.

A sharded causal LM keeps its logits split over the vocabulary (``parallel_output=True``); the
model's ``loss_function`` is replaced by :class:`VocabParallelCausalLMLoss`, which shifts the
labels exactly as transformers' ``ForCausalLMLoss`` does and reduces the same way (mean over the
non-ignored targets, or sum divided by ``num_items_in_batch`` when the trainer passes it), but
never builds the ``(tokens, vocab)`` logits on one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d import vocab_parallel_cross_entropy

__all__ = ["VocabParallelCausalLMLoss"]


class VocabParallelCausalLMLoss:
    """Drop-in ``loss_function`` for a transformers causal LM with a vocabulary-parallel head.

    Args:
        process_group: the tensor-parallel group the vocabulary is split over.
        vocab_size: the real vocabulary size (padding columns are excluded).

    Example:
        >>> loss_fn = VocabParallelCausalLMLoss(group, model.config.vocab_size)  # doctest: +SKIP
        >>> model.loss_function = loss_fn  # doctest: +SKIP
        >>> model(input_ids, labels=input_ids).loss  # COLLECTIVE  # doctest: +SKIP
    """

    def __init__(self, process_group: ProcessGroup, vocab_size: int) -> None:
        self.process_group = process_group
        self.vocab_size = vocab_size

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The loss; COLLECTIVE over the group (two all-reduces).

        ``logits`` are this rank's ``(batch, seq, vocab_local)`` slice; ``vocab_size`` (passed by
        the model) must equal the configured one. Other keyword arguments are the ones
        transformers forwards to every loss (e.g. attention flags) and play no part, as in
        transformers' own ``ForCausalLMLoss``.
        """
        if vocab_size is not None and vocab_size != self.vocab_size:
            raise ValueError(
                f"VocabParallelCausalLMLoss: the model passed vocab_size={vocab_size} but the head "
                f"was sharded with {self.vocab_size}; re-shard after resizing the vocabulary."
            )
        if shift_labels is None:
            # Tokens < n predict n: pad one ignored label at the end and shift left.
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(
            logits.float(),
            shift_labels.to(logits.device),
            self.process_group,
            vocab_size=self.vocab_size,
            ignore_index=ignore_index,
            reduction=reduction,
        )
        if num_items_in_batch is not None:
            if isinstance(num_items_in_batch, torch.Tensor):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss
