"""Checks on a batch of prompts before generation (shapes, left padding, lengths, and the same
prompts on every rank of a tensor-parallel group)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["check_prompts", "check_same_prompts"]


def check_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    max_batch_size: int,
    context: int,
    max_new_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a left-padded batch and return ``(input_ids, attention_mask)`` as int64.

    Args:
        input_ids: ``[batch, prompt_len]`` integer token ids.
        attention_mask: the same shape, 0 (padding, on the left only) or 1; ``None``: all ones.
        max_batch_size: the most rows allowed.
        context: the model's position limit; ``prompt_len + max_new_tokens`` must fit.
        max_new_tokens: tokens to generate.

    Raises:
        TypeError: not integer tensors.
        ValueError: wrong shape, empty, too many rows, values other than 0/1, padding on the
            right, a row of padding only, or a prompt too long for the context.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point():
        raise TypeError(f"input_ids must be an integer torch.Tensor, got {input_ids!r}.")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)}; it must be [batch, prompt_len] with "
            "both at least 1 (use input_ids[None] for one prompt)."
        )
    batch, length = input_ids.shape
    if batch > max_batch_size:
        raise ValueError(
            f"a batch of {batch} prompts is over InferenceConfig.max_batch_size="
            f"{max_batch_size}; split it or raise max_batch_size."
        )
    if length + max_new_tokens > context:
        raise ValueError(
            f"prompt length {length} + max_new_tokens {max_new_tokens} = "
            f"{length + max_new_tokens} is over the model's context of {context} positions "
            "(max_position_embeddings); shorten the prompt or lower max_new_tokens."
        )
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, "
            f"got {getattr(mask, 'shape', mask)!r}."
        )
    mask = mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (prompt tokens).")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask has padding after a prompt token: pad on the left "
            "(tokenizer.padding_side = 'left'), as generation appends on the right."
        )
    if bool((mask[:, -1] == 0).any()):
        raise ValueError("a row of attention_mask is all padding; every prompt needs a token.")
    return input_ids.long(), mask


def check_same_prompts(ids: torch.Tensor, mask: torch.Tensor, group: ProcessGroup) -> None:
    """Raise on every rank of ``group`` unless all of them passed the same prompts.

    Tensor-parallel ranks compute one model together, so different prompts on different ranks
    would silently mix them. Three small collectives (sync points): the shapes, the first
    rank's prompts, the verdict.

    Raises:
        ValueError: the ranks' ``input_ids`` or ``attention_mask`` differ.
    """
    shape = torch.tensor(ids.shape, dtype=torch.long, device=ids.device)
    bounds = torch.cat([shape, -shape])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    same = torch.equal(bounds[:2], -bounds[2:])  # max == min: one shape everywhere
    if same:
        mine = torch.stack([ids, mask])
        first = mine.clone()
        dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
        verdict = torch.tensor([int(torch.equal(first, mine))], device=ids.device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
        same = bool(verdict.item())
    if not same:
        raise ValueError(
            "the ranks of the tensor-parallel group passed different input_ids or "
            "attention_mask to generate(); every rank of a group must pass the same prompts "
            "(read or broadcast them from one rank)."
        )
