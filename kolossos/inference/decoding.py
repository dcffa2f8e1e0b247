"""The decoding loop: prefill the prompt, then one token per step until done.

A compact loop rather than Hugging Face's ``model.generate`` on the sharded model: every step is
visible (the forward, the token choice, the sync point between tensor-parallel ranks, the EOS
bookkeeping), and it is the loop continuous batching will extend (sequences joining and leaving
between steps). It reproduces ``generate``'s inputs exactly (position ids from the attention
mask, pad tokens after EOS), so greedy output matches it token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kolossos.inference.sampling import SamplingConfig, select_next_tokens

__all__ = ["DecodeRequest", "decode"]

TokenSync = Callable[[torch.Tensor], torch.Tensor]
"""Makes the chosen tokens identical on all ranks of a model replica (identity on one rank)."""


@dataclass(frozen=True, kw_only=True)
class DecodeRequest:
    """One validated batch to decode (built by the engine)."""

    input_ids: torch.Tensor
    """``[batch, prompt_len]`` int64, left-padded."""
    attention_mask: torch.Tensor
    """``[batch, prompt_len]`` int64, 0 on the left padding, 1 on the prompt."""
    eos_token_ids: tuple[int, ...]
    """A sequence stops at any of these (empty: never stop early)."""
    pad_token_id: int
    """Fills sequences after their EOS."""


def _position_ids(mask: torch.Tensor) -> torch.Tensor:
    # as transformers' generate: count real tokens; padding positions get 0 (they are masked)
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


@torch.no_grad()
def decode(
    model: nn.Module,
    request: DecodeRequest,
    config: SamplingConfig,
    *,
    cache_keyword: str,
    sync: TokenSync,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Generate up to ``config.max_new_tokens`` tokens after each prompt.

    Args:
        model: a causal LM (sharded or not) returning full-vocabulary logits.
        request: the left-padded prompts.
        config: greedy or sampling, length, cache on or off.
        cache_keyword: the model's name of the KV cache argument (:func:`cache_keyword`).
        sync: applied to each step's chosen tokens; under tensor parallelism a broadcast from
            the group's first rank (sync point), so every rank continues with the same tokens.
        generator: the sampling random source.

    Returns:
        ``[batch, prompt_len + n]`` int64: the prompts followed by ``n <= max_new_tokens`` new
        tokens (fewer when every sequence has finished), as ``model.generate`` returns them.
    """
    ids, mask = request.input_ids, request.attention_mask
    positions = _position_ids(mask)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    cache: Any = None
    eos = torch.tensor(request.eos_token_ids, dtype=torch.long, device=ids.device)
    for step in range(config.max_new_tokens):
        incremental = config.use_cache and step > 0
        inputs: dict[str, Any] = {
            "input_ids": ids[:, -1:] if incremental else ids,
            "attention_mask": mask,
            "position_ids": positions[:, -1:] if incremental else positions,
            "use_cache": config.use_cache,
        }
        if incremental:
            inputs[cache_keyword] = cache
        output = model(**inputs)
        if config.use_cache:
            cache = output[cache_keyword]
        tokens = sync(select_next_tokens(output.logits[:, -1, :], config, generator))
        if request.eos_token_ids:
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, request.pad_token_id))
            unfinished &= ~torch.isin(tokens, eos)
        ids = torch.cat([ids, tokens[:, None]], dim=-1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=-1)
        if not unfinished.any():
            break
    return ids
