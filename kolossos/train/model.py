"""The model: a Hugging Face ``GPT2LMHeadModel`` built from :class:`ModelSection`, its loss, and
text sampling."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from kolossos.train.config import ModelSection, SampleSection

__all__ = ["build_model", "causal_lm_loss", "count_parameters", "generate"]


def _transformers() -> Any:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import transformers
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "kolossos train builds a GPT-2 model with the 'transformers' package, which is not "
            "installed: pip install 'kolossos[hf]'  (or: pip install transformers)"
        ) from exc
    transformers.logging.set_verbosity_error()
    return transformers


def build_model(section: ModelSection, vocab_size: int) -> nn.Module:
    """A freshly initialised ``GPT2LMHeadModel`` (uses torch's global RNG: seed first).

    Args:
        section: layers, heads, width, context length and dropout.
        vocab_size: the tokenizer's vocabulary size.

    Example:
        >>> model = build_model(ModelSection(n_layer=1, n_embd=32, n_head=2), vocab_size=65)
    """
    transformers = _transformers()
    config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=section.block_size,
        n_embd=section.n_embd,
        n_layer=section.n_layer,
        n_head=section.n_head,
        resid_pdrop=section.dropout,
        embd_pdrop=section.dropout,
        attn_pdrop=section.dropout,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def causal_lm_loss(outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The criterion handed to the Booster: the model's own next-token loss.

    ``batch`` holds ``input_ids`` and ``labels`` (equal; the model shifts them), the layout
    pipeline schedules pass to the model as keyword arguments.
    """
    del batch  # the model computed the loss from the labels already
    loss: torch.Tensor = outputs.loss
    return loss


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    seen = {id(p): p.numel() for p in model.parameters()}
    return sum(seen.values())


@torch.no_grad()
def generate(
    model: nn.Module, prompt_ids: list[int], section: SampleSection, block: int, seed: int
) -> list[int]:
    """Sample ``section.tokens`` ids after ``prompt_ids`` (deterministic for a given seed).

    Args:
        model: a causal LM returning ``.logits``, on the CPU.
        prompt_ids: the prompt's ids (at least one).
        section: length, temperature and top-k.
        block: the model's context length (older tokens are cropped).
        seed: seeds the sampling generator.
    """
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    out: list[int] = []
    for _ in range(section.tokens):
        logits = model(input_ids=ids[:, -block:]).logits[0, -1].float() / section.temperature
        if 0 < section.top_k < logits.numel():
            kth = torch.topk(logits, section.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        out.append(int(nxt))
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    model.train(was_training)
    return out
