"""The model zoo's Vision Transformer (``model_zoo.vit.vit`` of Colossal-AI's tutorials), built
from the config-driven layers (:mod:`kolossos.legacy.nn.layer.colossalai_layer`), so one
definition follows the launch's ``parallel.tensor`` mode.

Pieces: :class:`ViTEmbedding` (patch embedding, class token, position embeddings, dropout),
:class:`ViTBlock` (pre-LN attention + MLP with stochastic depth and ``checkpoint=``),
:class:`ViTHead` (class token -> optional tanh representation -> classes), and
:class:`VisionTransformer` / :func:`_create_vit_model` (all of them in an ``nn.Sequential``
called ``layers``). The fused ``query_key_value`` output is laid out head-major
(``[head, (q|k|v), head_dim]``), so a column-parallel split gives each rank whole heads.

Under 1D tensor parallelism the attention and MLP linear layers alternate column- and
row-parallel; embedding, norms and head are replicated, so the logits are whole on every rank.
In 2d / 2.5d / 3d mode each layer is that mode's (patch embedding and classifier included):
activations are batch blocks, as with :class:`kolossos.legacy.models.VisionTransformerND`.

Example::

    model = _create_vit_model(img_size=32, patch_size=4, dim=64, depth=2, num_heads=4,
                              mlp_ratio=2, num_classes=10, init_method='jax', checkpoint=True)
    logits = model(images)        # [B, 10]
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import kolossos.legacy.nn as col_nn
from kolossos.legacy.models.vit_nd import PatchEmbedding
from kolossos.legacy.models.zoo_common import (
    CheckpointModule,
    DropPath,
    check_init_method,
    init_linear,
    nd_layers,
)

__all__ = [
    "ViTBlock",
    "ViTEmbedding",
    "ViTHead",
    "ViTMLP",
    "ViTSelfAttention",
    "VisionTransformer",
    "_create_vit_model",
]


class ViTEmbedding(nn.Module):
    """Images ``[B, C, H, W]`` to tokens ``[B, (H/p)*(W/p) + 1, embedding_dim]``.

    Args:
        img_size: image side. patch_size: patch side. in_chans: image channels.
        embedding_dim: token width. dropout: dropout after adding position embeddings.
        dtype: parameter dtype. flatten: must be True (tokens, not a feature map).
        init_method: ``'torch'`` or ``'jax'`` (LeCun-normal patch weights, position embeddings
            from ``N(0, 0.02)``).
    """

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embedding_dim: int,
        dropout: float,
        dtype: torch.dtype | None = None,
        flatten: bool = True,
        init_method: str = "torch",
    ) -> None:
        super().__init__()
        check_init_method(init_method)
        if not flatten:
            raise NotImplementedError("ViTEmbedding(flatten=False) is not supported.")
        if img_size % patch_size:
            raise ValueError(f"img_size={img_size} is not divisible by patch_size={patch_size}.")
        nd = nd_layers()
        self.patch_embed: nn.Module
        if nd is not None:
            self.patch_embed = nd.patch_embedding(img_size, patch_size, in_chans, embedding_dim)
        else:
            dense = PatchEmbedding(img_size, patch_size, in_chans, embedding_dim)
            if dtype is not None:
                dense.to(dtype)
            if init_method == "jax":
                _jax_patch_init(dense, in_chans * patch_size**2)
            self.patch_embed = dense
        self.dropout = col_nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.patch_embed(x))


@torch.no_grad()
def _jax_patch_init(embed: PatchEmbedding, fan_in: int) -> None:
    nn.init.trunc_normal_(embed.weight, std=math.sqrt(1.0 / fan_in))
    embed.bias.zero_()
    nn.init.trunc_normal_(embed.pos_embed, std=0.02)


class ViTSelfAttention(nn.Module):
    """Multi-head self-attention over this rank's heads (head-major fused ``query_key_value``)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attention_dropout: float,
        dropout: float,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        init_method: str = "torch",
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}.")
        self.attention_head_size = dim // num_heads
        # built in forward order: 1D alternates column/row layers, 3D takes groups in order
        self.query_key_value = col_nn.Linear(dim, 3 * dim, bias=bias, dtype=dtype)
        self.attention_dropout = col_nn.Dropout(attention_dropout)
        self.dense = col_nn.Linear(dim, dim, bias=bias, dtype=dtype)
        self.dropout = col_nn.Dropout(dropout)
        init_linear(self.query_key_value, dim, 3 * dim, init_method)
        init_linear(self.dense, dim, dim, init_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.query_key_value(x)
        b, s, width = qkv.shape
        heads = width // (3 * self.attention_head_size)  # this rank's heads
        qkv = qkv.view(b, s, heads, 3 * self.attention_head_size).permute(0, 2, 1, 3)
        q, k, v = torch.chunk(qkv, 3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        probs = self.attention_dropout(torch.softmax(scores, dim=-1))
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, heads * self.attention_head_size)
        return self.dropout(self.dense(ctx))


class ViTMLP(nn.Module):
    """``dropout(dense_2(dropout(activation(dense_1(x)))))``."""

    def __init__(
        self,
        dim: int,
        mlp_ratio: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
        dropout: float,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        init_method: str = "torch",
    ) -> None:
        super().__init__()
        hidden = int(mlp_ratio * dim)
        self.dense_1 = col_nn.Linear(dim, hidden, bias=bias, dtype=dtype)
        self.activation = activation
        self.dropout_1 = col_nn.Dropout(dropout)
        self.dense_2 = col_nn.Linear(hidden, dim, bias=bias, dtype=dtype)
        self.dropout_2 = col_nn.Dropout(dropout)
        init_linear(self.dense_1, dim, hidden, init_method, bias_std=1e-6)
        init_linear(self.dense_2, hidden, dim, init_method, bias_std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout_1(self.activation(self.dense_1(x)))
        return self.dropout_2(self.dense_2(x))


class ViTHead(nn.Module):
    """The class token (token 0) to logits, through ``tanh(representation(x))`` when
    ``representation_size`` is given. Replicated under 1D TP (whole logits on every rank); the
    mode's classifier in 2d / 2.5d / 3d mode. ``'jax'`` init zeroes the classifier."""

    def __init__(
        self,
        dim: int,
        num_classes: int,
        representation_size: int | None = None,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        init_method: str = "torch",
    ) -> None:
        super().__init__()
        check_init_method(init_method)
        nd = nd_layers()
        self.representation: nn.Module | None = None
        width = dim
        if representation_size:
            self.representation = (
                nd.linear(dim, representation_size, bias, dtype)
                if nd is not None
                else nn.Linear(dim, representation_size, bias=bias, dtype=dtype)
            )
            init_linear(self.representation, dim, representation_size, init_method)
            width = representation_size
        if nd is not None:
            self.dense = nd.classifier(width, num_classes)
        else:
            self.dense = nn.Linear(width, num_classes, bias=bias, dtype=dtype)
        if init_method == "jax":
            with torch.no_grad():
                for p in self.dense.parameters():
                    p.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, 0]
        if self.representation is not None:
            x = torch.tanh(self.representation(x))
        return self.dense(x)


class ViTBlock(CheckpointModule):
    """Pre-LN transformer block: ``x + drop_path(attn(norm1(x)))`` then
    ``x + drop_path(mlp(norm2(x)))``; ``checkpoint=True`` recomputes its activations in
    backward."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
        attention_dropout: float = 0.0,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        layernorm_epsilon: float = 1e-6,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        checkpoint: bool = False,
        init_method: str = "torch",
        activation_offload: bool = False,
    ) -> None:
        super().__init__(checkpoint, activation_offload)
        check_init_method(init_method)
        self.norm1 = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        self.attn = ViTSelfAttention(
            dim, num_heads, attention_dropout, dropout, bias, dtype, init_method
        )
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        self.mlp = ViTMLP(dim, mlp_ratio, activation, dropout, dtype, bias, init_method)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    """The whole ViT: ``layers = nn.Sequential(embedding, *blocks, norm, head)``, images to
    logits. Arguments as Colossal-AI's model zoo (``dim`` is the token width, ``depth`` the
    number of blocks, ``drop_path`` the last block's stochastic-depth rate, rising linearly from
    0)."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        depth: int = 12,
        num_heads: int = 12,
        dim: int = 768,
        mlp_ratio: int = 4,
        attention_dropout: float = 0.0,
        dropout: float = 0.1,
        drop_path: float = 0.0,
        layernorm_epsilon: float = 1e-6,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
        representation_size: int | None = None,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        checkpoint: bool = False,
        init_method: str = "torch",
    ) -> None:
        super().__init__()
        embed = ViTEmbedding(img_size, patch_size, in_chans, dim, dropout, dtype, True, init_method)
        dpr = [x.item() for x in torch.linspace(0, drop_path, depth)]
        blocks = [
            ViTBlock(
                dim, num_heads, mlp_ratio, activation, attention_dropout, dropout, dpr[i],
                layernorm_epsilon, dtype, bias, checkpoint, init_method,
            )
            for i in range(depth)
        ]  # fmt: skip
        norm = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        head = ViTHead(dim, num_classes, representation_size, dtype, bias, init_method)
        self.layers = nn.Sequential(embed, *blocks, norm, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _create_vit_model(**model_kwargs: object) -> VisionTransformer:
    """``VisionTransformer(**model_kwargs)`` (the tutorial's non-pipeline fallback)."""
    return VisionTransformer(**model_kwargs)  # type: ignore[arg-type]
