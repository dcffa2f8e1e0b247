"""Vocabulary padding and per-rank vocabulary ranges shared by the embedding and the LM head."""

from __future__ import annotations

__all__ = ["padded_vocab_size", "vocab_range", "vocab_shard"]


def padded_vocab_size(num_embeddings: int, tp_size: int, make_vocab_size_divisible_by: int) -> int:
    """``num_embeddings`` rounded up to a multiple of ``make_vocab_size_divisible_by * tp_size``
    (Megatron's rule), so every rank holds the same number of rows.

    Raises:
        ValueError: a size is not positive.
    """
    if num_embeddings <= 0 or tp_size <= 0 or make_vocab_size_divisible_by <= 0:
        raise ValueError(
            f"vocabulary padding needs positive sizes, got num_embeddings={num_embeddings}, "
            f"tp_size={tp_size}, make_vocab_size_divisible_by={make_vocab_size_divisible_by}."
        )
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-num_embeddings // multiple) * multiple


def vocab_range(padded_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the vocabulary rows held by ``tp_rank``."""
    per_rank = padded_size // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def vocab_shard(
    vocab_size: int, tp_rank: int, tp_size: int, make_vocab_size_divisible_by: int
) -> tuple[int, int, int]:
    """``(padded_size, start, end)``: the padded vocabulary size (:func:`padded_vocab_size`) and
    the ``[start, end)`` rows of it held by ``tp_rank``."""
    padded = padded_vocab_size(vocab_size, tp_size, make_vocab_size_divisible_by)
    start, end = vocab_range(padded, tp_rank, tp_size)
    return padded, start, end
