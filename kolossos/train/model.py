"""The model: a Hugging Face ``GPT2LMHeadModel`` built from :class:`ModelSection`, its loss, and
text sampling."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from kolossos.train.config import ModelSection, SampleSection
from kolossos.train.hf_import import enable_activation_checkpointing
from kolossos.train.hf_import import transformers_module as _transformers

__all__ = [
    "build_model",
    "causal_lm_loss",
    "count_parameters",
    "generate",
]


def build_model(section: ModelSection, vocab_size: int, *, load_weights: bool = True) -> nn.Module:
    """The run's model: a freshly initialised ``GPT2LMHeadModel`` (uses torch's global RNG:
    seed first), or the Hugging Face model of ``model.pretrained`` / ``model.config``.

    Args:
        section: layers, heads, width, context length and dropout (or the HF source).
        vocab_size: the tokenizer's vocabulary size.
        load_weights: load ``model.pretrained``'s weights (``False``: only its architecture,
            to load a checkpoint into).

    Example:
        >>> model = build_model(ModelSection(n_layer=1, n_embd=32, n_head=2), vocab_size=65)
    """
    if section.hf_source is not None:
        from kolossos.train.hf_model import build_hf_model

        hf: nn.Module = build_hf_model(section, vocab_size, load_weights=load_weights)
        return hf
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
    if section.activation_checkpointing:
        enable_activation_checkpointing(model)
    return model


def causal_lm_loss(outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The criterion handed to the Booster: the model's own next-token loss.

    ``batch`` holds ``input_ids`` and ``labels`` (the model shifts them; ``-100`` labels are not
    trained on), the layout
    pipeline schedules pass to the model as keyword arguments.
    """
    labels = batch.get("labels")
    if labels is not None and not bool((labels[..., 1:] != -100).any()):
        # every target masked (a packed sequence of prompt tokens): the model's mean is 0/0
        zero: torch.Tensor = outputs.logits.sum() * 0.0
        return zero
    loss: torch.Tensor = outputs.loss  # the model computed it from the labels already
    return loss


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    seen = {id(p): p.numel() for p in model.parameters()}
    return sum(seen.values())


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    section: SampleSection,
    block: int,
    seed: int,
    stop_id: int | None = None,
) -> list[int]:
    """Sample ``section.tokens`` ids after ``prompt_ids`` (deterministic for a given seed).

    Args:
        model: a causal LM returning ``.logits``, on the CPU.
        prompt_ids: the prompt's ids (at least one).
        section: length, temperature and top-k.
        block: the model's context length (older tokens are cropped).
        seed: seeds the sampling generator.
        stop_id: end early when this id (end of text) is drawn; it is not returned.
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
        if stop_id is not None and int(nxt) == stop_id:
            break
        out.append(int(nxt))
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    model.train(was_training)
    return out
