"""The model zoo's GPT (``model_zoo.gpt.gpt`` of Colossal-AI's GPT tutorial), built from the
config-driven layers (:mod:`kolossos.legacy.nn.layer.colossalai_layer`): without tensor
parallelism plain torch layers, under ``parallel.tensor.mode='1d'`` Megatron-style column/row
linear layers over whole heads, a split embedding and an LM head whose weight has the
embedding's shape and split (so the two can be tied, also across pipeline stages with
:class:`~kolossos.legacy.nn.PipelineSharedModuleWrapper`).

Pieces: :class:`GPTEmbedding` (word + position embeddings, dropout), :class:`GPTBlock` (pre-LN
causal self-attention + MLP; ``forward(x, attention_mask)`` returns ``(x, attention_mask)``;
``checkpoint=``), :class:`GPTLMHead` (hidden -> vocabulary logits, whole on every rank),
:class:`GPTLMLoss` (next-token cross-entropy) and :class:`GPT` (all of them, head tied to the
word embedding). 2d / 2.5d / 3d modes are not supported by these classes (NotImplementedError).

Example::

    model = GPT(vocab_size=128, max_position_embeddings=16, dim=32, num_heads=4, depth=2)
    logits = model(input_ids, attention_mask)          # [B, S, 128]
    loss = GPTLMLoss()(logits, input_ids)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import kolossos.legacy.nn as col_nn
from kolossos.legacy.models.zoo_common import CheckpointModule, tensor_mode
from kolossos.legacy.tensor_parallel import (
    get_tensor_parallel_group,
    read_tensor_parallel_settings,
)
from kolossos.nn.layer.parallel_1d import Linear1D_Col, Linear1D_Row
from kolossos.utils import get_current_device

__all__ = [
    "GPT",
    "GPTMLP",
    "GPTBlock",
    "GPTEmbedding",
    "GPTLMHead",
    "GPTLMLoss",
    "GPTSelfAttention",
    "extend_attention_mask",
]

VOCAB_PARALLEL_LIMIT = 2048
"""``kolossos.nn.Embedding`` splits vocabularies above this many rows over the vocabulary, and
smaller ones over the embedding dimension (the LM head follows the same rule)."""


def _check_mode(owner: str) -> str | None:
    mode = tensor_mode()
    if mode not in (None, "1d"):
        raise NotImplementedError(
            f"{owner} supports no tensor parallelism or parallel.tensor.mode='1d', not "
            f"mode={mode!r}; use mode='1d' (or the ViT zoo, which follows every mode)."
        )
    return mode


def extend_attention_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``[B, S]`` 1/0 padding mask to the additive ``[B, 1, 1, S]`` form the blocks take:
    ``(1 - mask) * -10000``."""
    mask = attention_mask.view(attention_mask.shape[0], -1)[:, None, None, :].to(dtype)
    return (1.0 - mask) * -10000.0


class GPTEmbedding(nn.Module):
    """``dropout(word_embeddings(input_ids) + position_embeddings(positions))``.

    Args:
        embedding_dim: hidden size. vocab_size: vocabulary rows.
        max_position_embeddings: the longest sequence. num_tokentypes: token-type rows (0: none).
        padding_idx: the word embedding's padding row. dropout: embedding dropout.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        embedding_dim: int,
        vocab_size: int,
        max_position_embeddings: int,
        num_tokentypes: int = 0,
        padding_idx: int | None = None,
        dropout: float = 0.0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_mode("GPTEmbedding")
        self.word_embeddings = col_nn.Embedding(vocab_size, embedding_dim, padding_idx, dtype)
        self.position_embeddings = col_nn.Embedding(
            max_position_embeddings, embedding_dim, dtype=dtype
        )
        self.tokentype_embeddings = (
            col_nn.Embedding(num_tokentypes, embedding_dim, dtype=dtype)
            if num_tokentypes > 0
            else None
        )
        self.dropout = col_nn.Dropout(dropout)

    @property
    def word_embedding_weight(self) -> torch.Tensor:
        """The word embedding (this rank's part under tensor parallelism)."""
        return self.word_embeddings.weight  # type: ignore[return-value]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        if self.tokentype_embeddings is not None and tokentype_ids is not None:
            x = x + self.tokentype_embeddings(tokentype_ids)
        return self.dropout(x)


class GPTSelfAttention(nn.Module):
    """Causal multi-head self-attention over this rank's heads (head-major fused
    ``query_key_value``); ``attention_mask`` is the additive ``[B, 1, 1, S]`` mask."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attention_dropout: float,
        dropout: float,
        bias: bool = True,
        fuse_scale_mask_softmax: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if fuse_scale_mask_softmax:
            raise NotImplementedError(
                "fuse_scale_mask_softmax=True (a CUDA kernel) is not supported."
            )
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}.")
        self.attention_head_size = dim // num_heads
        self.query_key_value = col_nn.Linear(dim, 3 * dim, bias=bias, dtype=dtype)
        self.attention_dropout = col_nn.Dropout(attention_dropout)
        self.dense = col_nn.Linear(dim, dim, bias=bias, dtype=dtype)
        self.dropout = col_nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.query_key_value(x)
        b, s, width = qkv.shape
        heads = width // (3 * self.attention_head_size)
        qkv = qkv.view(b, s, heads, 3 * self.attention_head_size).permute(0, 2, 1, 3)
        q, k, v = torch.chunk(qkv, 3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = torch.where(causal, scores, scores.new_tensor(-10000.0))
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = self.attention_dropout(torch.softmax(scores, dim=-1))
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, heads * self.attention_head_size)
        return self.dropout(self.dense(ctx))


class GPTMLP(nn.Module):
    """``dropout(dense_2(activation(dense_1(x))))``."""

    def __init__(
        self,
        dim: int,
        mlp_ratio: float,
        activation: Callable[[torch.Tensor], torch.Tensor],
        dropout: float,
        dtype: torch.dtype | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        hidden = int(mlp_ratio * dim)
        self.dense_1 = col_nn.Linear(dim, hidden, bias=bias, dtype=dtype)
        self.activation = activation
        self.dense_2 = col_nn.Linear(hidden, dim, bias=bias, dtype=dtype)
        self.dropout = col_nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.dense_2(self.activation(self.dense_1(x))))


class GPTBlock(CheckpointModule):
    """A GPT layer: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))`` (pre-LN; post-LN with
    ``apply_post_layernorm``). ``forward(x, attention_mask)`` returns ``(x, attention_mask)``
    so blocks chain; ``checkpoint=True`` recomputes the block's activations in backward."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
        attention_dropout: float = 0.0,
        dropout: float = 0.0,
        layernorm_epsilon: float = 1e-5,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        apply_post_layernorm: bool = False,
        fuse_scale_mask_softmax: bool = False,
        checkpoint: bool = False,
        activation_offload: bool = False,
    ) -> None:
        super().__init__(checkpoint, activation_offload)
        _check_mode("GPTBlock")
        self.apply_post_layernorm = apply_post_layernorm
        self.norm1 = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        self.attn = GPTSelfAttention(
            dim, num_heads, attention_dropout, dropout, bias, fuse_scale_mask_softmax, dtype
        )
        self.norm2 = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        self.mlp = GPTMLP(dim, mlp_ratio, activation, dropout, dtype, bias)

    def _forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.apply_post_layernorm:
            x = self.norm1(x)
            x = x + self.attn(x, attention_mask)
            x = self.norm2(x)
            return x + self.mlp(x), attention_mask
        x = x + self.attn(self.norm1(x), attention_mask)
        return x + self.mlp(self.norm2(x)), attention_mask


class GPTLMHead(nn.Module):
    """Hidden states ``[B, S, dim]`` to whole vocabulary logits ``[B, S, vocab_size]``.

    ``self.dense.weight`` has the shape and split of :class:`GPTEmbedding`'s word embedding on
    every rank (1D: split over ``dim`` for vocabularies up to ``VOCAB_PARALLEL_LIMIT`` rows, over
    the vocabulary above), so the two can be tied: pass ``word_embeddings_weight`` (same stage)
    or register both with a ``PipelineSharedModuleWrapper`` (different stages).

    Args:
        dim: hidden size. vocab_size: vocabulary rows.
        word_embeddings_weight: tie the head to this (this rank's) word-embedding weight.
        bias: add a bias (not tied). dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        vocab_size: int,
        word_embeddings_weight: nn.Parameter | None = None,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        mode = _check_mode("GPTLMHead")
        device = get_current_device()
        self.dense: nn.Module
        if mode is None:
            self.dense = nn.Linear(dim, vocab_size, bias=bias, dtype=dtype, device=device)
        else:
            group = get_tensor_parallel_group(read_tensor_parallel_settings())
            if vocab_size <= VOCAB_PARALLEL_LIMIT:  # like Embedding1D: split over dim
                self.dense = Linear1D_Row(
                    dim, vocab_size, bias, dtype, device, group, parallel_input=False
                )
            else:  # like VocabParallelEmbedding1D: split over the vocabulary
                self.dense = Linear1D_Col(
                    dim, vocab_size, bias, dtype, device, group, gather_output=True
                )
        if word_embeddings_weight is not None:
            if word_embeddings_weight.shape != self.dense.weight.shape:
                raise ValueError(
                    f"GPTLMHead: word_embeddings_weight of shape "
                    f"{tuple(word_embeddings_weight.shape)} cannot be tied to this rank's head "
                    f"weight {tuple(self.dense.weight.shape)}; build both with the same "
                    "vocab_size and dim under the same tensor mode."
                )
            self.dense.weight = word_embeddings_weight

    @property
    def weight(self) -> torch.Tensor:
        """The head weight (this rank's part)."""
        return self.dense.weight  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


class GPTLMLoss(nn.Module):
    """Next-token cross-entropy: ``logits[..., :-1, :]`` against ``labels[..., 1:]``."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = col_nn.CrossEntropyLoss()

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss(shift_logits.view(-1, shift_logits.shape[-1]), shift_labels.view(-1))


class GPT(nn.Module):
    """The whole GPT: embedding, ``depth`` :class:`GPTBlock`, final LayerNorm and an LM head tied
    to the word embedding. ``forward(input_ids, attention_mask=None)`` returns the logits."""

    def __init__(
        self,
        vocab_size: int = 50304,
        max_position_embeddings: int = 1024,
        dim: int = 768,
        num_heads: int = 12,
        depth: int = 12,
        mlp_ratio: float = 4.0,
        dropout: float = 0.1,
        embedding_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        apply_post_layernorm: bool = False,
        fuse_scale_mask_softmax: bool = False,
        checkpoint: bool = False,
        activation_offload: bool = False,
    ) -> None:
        super().__init__()
        self.embed = GPTEmbedding(
            dim, vocab_size, max_position_embeddings, 0, padding_idx, embedding_dropout, dtype
        )
        self.blocks = nn.ModuleList(
            GPTBlock(
                dim, num_heads, mlp_ratio, activation, attention_dropout, dropout,
                layernorm_epsilon, dtype, bias, apply_post_layernorm, fuse_scale_mask_softmax,
                checkpoint, activation_offload,
            )
            for _ in range(depth)
        )  # fmt: skip
        self.norm = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        word = self.embed.word_embedding_weight
        assert isinstance(word, nn.Parameter)
        self.head = GPTLMHead(dim, vocab_size, word, dtype=dtype)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        mask = None if attention_mask is None else extend_attention_mask(attention_mask, x.dtype)
        for block in self.blocks:
            x, mask = block(x, mask)
        return self.head(self.norm(x))
