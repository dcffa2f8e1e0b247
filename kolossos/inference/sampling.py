"""Choosing the next token from the logits: greedy, or sampling with temperature, top-k and top-p.

The order of the sampling filters is Hugging Face's (temperature, then top-k, then top-p), so a
setting means the same here as in ``model.generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingConfig", "select_next_tokens"]


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How one :meth:`~kolossos.inference.InferenceEngine.generate` call picks its tokens.

    Example:
        >>> SamplingConfig(max_new_tokens=16, do_sample=True, top_k=50, top_p=0.9, seed=0)
        SamplingConfig(max_new_tokens=16, do_sample=True, temperature=1.0, top_k=50, top_p=0.9, \
eos_token_id=None, pad_token_id=None, use_cache=True, seed=0)
    """

    max_new_tokens: int = 32
    """Tokens generated after the prompt (fewer when every sequence has met ``eos_token_id``)."""
    do_sample: bool = False
    """``False``: greedy (the most likely token); ``True``: sample from the filtered softmax."""
    temperature: float = 1.0
    """Divides the logits before sampling (> 0; read only when ``do_sample``)."""
    top_k: int | None = None
    """Keep only the ``top_k`` most likely tokens (``None`` or 0: keep all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability sums to ``top_p``
    (nucleus sampling, in (0, 1]; 1.0 keeps all)."""
    eos_token_id: int | None = None
    """A sequence stops at this token and is filled with ``pad_token_id`` afterwards
    (``None``: the model config's ``eos_token_id``; -1: never stop early)."""
    pad_token_id: int | None = None
    """Fills finished sequences (``None``: the model config's ``pad_token_id``, else the EOS)."""
    use_cache: bool = True
    """Keep each layer's keys and values (the model's own ``DynamicCache``) and feed only the
    newest token per step; ``False`` re-runs the whole sequence every step (same tokens)."""
    seed: int | None = None
    """Seed of the sampling ``torch.Generator`` (the same on every tensor-parallel rank);
    ``None``: torch's global generator, unless ``generate`` is given one."""

    def __post_init__(self) -> None:
        for name in ("do_sample", "use_cache"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingConfig.{name}={getattr(self, name)!r} must be a bool.")
        if _not_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingConfig.max_new_tokens={self.max_new_tokens!r} must be an int >= 1."
            )
        if not isinstance(self.temperature, int | float) or not self.temperature > 0:
            raise ValueError(
                f"SamplingConfig.temperature={self.temperature!r} must be a number > 0; for "
                "deterministic output use do_sample=False (greedy)."
            )
        if self.top_k is not None and (_not_int(self.top_k) or self.top_k < 0):
            raise ValueError(
                f"SamplingConfig.top_k={self.top_k!r} must be None or an int >= 0 (0: no top-k)."
            )
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p!r} must be in (0, 1].")
        for name in ("eos_token_id", "pad_token_id", "seed"):
            value = getattr(self, name)
            if value is not None and _not_int(value):
                raise TypeError(f"SamplingConfig.{name}={value!r} must be None or an int.")


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _filter_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k and top-p applied to ``[batch, vocab]`` fp32 logits (removed: -inf)."""
    logits = logits / config.temperature
    if config.top_k:
        k = min(config.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token once the tokens before it already reach top_p; the first always stays
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= config.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def select_next_tokens(
    logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token of each sequence from its last-position logits.

    Args:
        logits: ``[batch, vocab]`` logits of the last position (full vocabulary).
        config: greedy or sampling, and the sampling filters.
        generator: the random source for sampling (``None``: torch's global one).

    Returns:
        ``[batch]`` token ids (int64).
    """
    logits = logits.float()
    if not config.do_sample:
        return logits.argmax(dim=-1)
    probs = _filter_logits(logits, config).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
