"""Synthetic masked-LM batches (nothing is downloaded) and each rank's sequence chunk.

Every sentence is an arithmetic progression, modulo ``PERIOD``, of the first word ids (a random
start and stride), padded at the end, with ``masked`` of its real tokens replaced by ``[MASK]``:
a masked token is predictable from its neighbours, so the loss falls as the model learns. Every
rank draws the same global batch from the step's seed, keeps its data-parallel replica's rows and
its sequence chunk's columns (Colossal-AI's ``get_batch_for_sequence_parallel``; the padding mask
stays whole, as the attention of every chunk needs every key).
"""

from __future__ import annotations

import torch

PAD, MASK, FIRST_WORD = 0, 1, 2
PERIOD = 16  # the sentences use the word ids FIRST_WORD ... FIRST_WORD + PERIOD - 1
IGNORE = -100  # label of the positions that are not masked-LM targets


def synthetic_batch(
    step: int, batch_size: int, seq_length: int, vocab_size: int, masked: int, seed: int
) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: ``tokens`` and ``labels`` ``[batch, seq]`` (labels are
    ``IGNORE`` except at the masked positions) and ``padding_mask`` ``[batch, seq]`` (1 = real
    token, as the tutorial's data)."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    words = min(PERIOD, vocab_size - FIRST_WORD)
    start = torch.randint(0, words, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    text = FIRST_WORD + (start + stride * torch.arange(seq_length)) % words
    lengths = torch.randint(seq_length // 2, seq_length + 1, (batch_size,), generator=gen)
    padding_mask = (torch.arange(seq_length)[None, :] < lengths[:, None]).long()
    labels = torch.full_like(text, IGNORE)
    tokens = text.masked_fill(padding_mask == 0, PAD)
    for row, length in enumerate(lengths.tolist()):
        where = torch.randperm(length, generator=gen)[:masked]
        labels[row, where] = text[row, where]
        tokens[row, where] = MASK
    return {"tokens": tokens, "labels": labels, "padding_mask": padding_mask}


def get_batch_for_sequence_parallel(
    batch: dict[str, torch.Tensor], dp_rank: int, dp_size: int, sp_rank: int, sp_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, labels, padding_mask)`` of this rank: its replica's rows, its chunk's tokens
    and labels, the whole padding mask."""
    rows = batch["tokens"].shape[0] // dp_size
    sub = batch["tokens"].shape[1] // sp_size
    r, c = slice(dp_rank * rows, (dp_rank + 1) * rows), slice(sp_rank * sub, (sp_rank + 1) * sub)
    return batch["tokens"][r, c], batch["labels"][r, c], batch["padding_mask"][r]
