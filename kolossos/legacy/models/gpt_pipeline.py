"""The hand-split GPT of the GPT-2 / GPT-3 hybrid-parallel tutorial: each pipeline rank builds
only its own layers (GPT-3 does not fit in one host's memory), and the word embedding of the
first stage is tied to the LM head of the last with a
:class:`~kolossos.legacy.nn.PipelineSharedModuleWrapper`.

``GPT2_exlarge_pipeline_hybrid`` (48 layers, hidden 1600, 32 heads) and ``GPT3_pipeline_hybrid``
(96 layers, hidden 12288, 96 heads, 2048 positions) take keyword overrides, so the same builders
run at test size::

    model = GPT2_exlarge_pipeline_hybrid(num_chunks=1, num_layers=4, hidden_size=32,
                                         num_attention_heads=4, vocab_size=256,
                                         max_position_embeddings=16)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kolossos.legacy.nn as col_nn
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.models.gpt import GPTBlock, GPTEmbedding, GPTLMHead, extend_attention_mask
from kolossos.logging import get_dist_logger
from kolossos.pipeline import partition_uniform
from kolossos.utils import get_current_device

__all__ = [
    "GPT2_exlarge_pipeline_hybrid",
    "GPT3_pipeline_hybrid",
    "PipelineGPTHybrid",
    "build_gpt_pipeline",
]


def _global_rank() -> int:
    return gpc.get_global_rank() if gpc.is_initialized(ParallelMode.GLOBAL) else 0


class PipelineGPTHybrid(nn.Module):
    """``num_layers`` GPT blocks, with the embedding when ``first`` and the final norm and LM
    head when ``last``.

    ``forward(hidden_states=None, input_ids=None, attention_mask=None)``: the first stage embeds
    ``input_ids`` (the batch's keyword arguments), later stages take the previous stage's output
    as ``hidden_states``; the ``[B, S]`` ``attention_mask`` reaches every stage. Returns the
    hidden states, or the logits on the last stage.
    """

    def __init__(
        self,
        num_layers: int = 12,
        hidden_size: int = 768,
        num_attention_heads: int = 12,
        vocab_size: int = 50304,
        embed_drop_rate: float = 0.0,
        act_func: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
        mlp_ratio: int = 4,
        attn_drop_rate: float = 0.0,
        drop_rate: float = 0.0,
        dtype: torch.dtype = torch.float,
        checkpoint: bool = False,
        max_position_embeddings: int = 1024,
        layer_norm_epsilon: float = 1e-5,
        first: bool = False,
        last: bool = False,
    ) -> None:
        super().__init__()
        self.embedding: GPTEmbedding | None = None
        self.norm: nn.Module | None = None
        self.head: GPTLMHead | None = None
        if first:
            self.embedding = GPTEmbedding(
                hidden_size, vocab_size, max_position_embeddings, dropout=embed_drop_rate,
                dtype=dtype,
            )  # fmt: skip
        self.blocks = nn.ModuleList(
            GPTBlock(
                hidden_size, num_attention_heads, mlp_ratio=mlp_ratio,
                attention_dropout=attn_drop_rate, dropout=drop_rate, dtype=dtype,
                checkpoint=checkpoint, activation=act_func,
            )
            for _ in range(num_layers)
        )  # fmt: skip
        if last:
            self.norm = col_nn.LayerNorm(hidden_size, eps=layer_norm_epsilon, dtype=dtype)
            self.head = GPTLMHead(vocab_size=vocab_size, dim=hidden_size, dtype=dtype, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.embedding is not None:
            if input_ids is None:
                raise ValueError("the first GPT stage needs input_ids (the batch's keyword).")
            hidden_states = self.embedding(input_ids=input_ids)
        if hidden_states is None:
            raise ValueError("a later GPT stage needs hidden_states (the previous stage's output).")
        mask = None
        if attention_mask is not None:
            mask = extend_attention_mask(attention_mask, hidden_states.dtype)
        for block in self.blocks:
            hidden_states, mask = block(hidden_states, mask)
        if self.norm is not None and self.head is not None:
            hidden_states = self.head(self.norm(hidden_states))
        return hidden_states


def build_gpt_pipeline(
    num_layers: int, num_chunks: int, device: torch.device | str | None = None, **kwargs: Any
) -> nn.Module:
    """This pipeline rank's :class:`PipelineGPTHybrid` chunk(s), ``num_layers`` blocks split
    uniformly, the first chunk's word embedding tied to the last chunk's head. Every rank must
    call it (building the tie's process groups is collective). ``kwargs`` are the model's;
    ``device`` default: the current device. Returns one module or an ``nn.ModuleList``."""
    logger = get_dist_logger()
    pipelined = gpc.is_initialized(ParallelMode.PIPELINE)
    size = gpc.get_world_size(ParallelMode.PIPELINE) if pipelined else 1
    rank = gpc.get_local_rank(ParallelMode.PIPELINE) if pipelined else 0
    wrapper = col_nn.PipelineSharedModuleWrapper([0, size - 1]) if size > 1 else None
    models: list[nn.Module] = []
    for start, end in partition_uniform(num_layers, size, num_chunks)[rank]:
        kwargs.update(num_layers=end - start, first=start == 0, last=end == num_layers)
        logger.info(
            f"Rank{_global_rank()} build layer {start}-{end}, {end - start}/{num_layers} layers"
        )
        chunk = PipelineGPTHybrid(**kwargs).to(
            device if device is not None else get_current_device()
        )
        if wrapper is not None and chunk.embedding is not None:
            wrapper.register_module(chunk.embedding.word_embeddings)
        elif wrapper is not None and chunk.head is not None:
            wrapper.register_module(chunk.head)
        elif chunk.embedding is not None and chunk.head is not None:  # one stage: tie in place
            chunk.head.dense.weight = chunk.embedding.word_embeddings.weight
        models.append(chunk)
    return models[0] if len(models) == 1 else nn.ModuleList(models)


def GPT2_exlarge_pipeline_hybrid(
    num_chunks: int = 1,
    checkpoint: bool = False,
    dtype: torch.dtype = torch.float,
    **overrides: Any,
) -> nn.Module:
    """GPT-2 XL (48 layers, hidden 1600, 32 heads) split over the pipeline; ``overrides`` (e.g.
    ``num_layers``, ``hidden_size``, ``num_attention_heads``, ``vocab_size``,
    ``max_position_embeddings``) change the sizes."""
    cfg: dict[str, Any] = dict(
        num_layers=48, hidden_size=1600, num_attention_heads=32, checkpoint=checkpoint, dtype=dtype
    )
    cfg.update(overrides)
    return build_gpt_pipeline(cfg.pop("num_layers"), num_chunks, **cfg)


def GPT3_pipeline_hybrid(
    num_chunks: int = 1,
    checkpoint: bool = False,
    dtype: torch.dtype = torch.float,
    **overrides: Any,
) -> nn.Module:
    """GPT-3 (96 layers, hidden 12288, 96 heads, 2048 positions) split over the pipeline;
    ``overrides`` change the sizes as for :func:`GPT2_exlarge_pipeline_hybrid`."""
    cfg: dict[str, Any] = dict(
        num_layers=96, hidden_size=12288, num_attention_heads=96, checkpoint=checkpoint,
        max_position_embeddings=2048, dtype=dtype,
    )  # fmt: skip
    cfg.update(overrides)
    return build_gpt_pipeline(cfg.pop("num_layers"), num_chunks, **cfg)
