"""WideNet ("Go Wider Instead of Deeper", arXiv 2107.11817): a ViT whose blocks share one
self-attention, one router and one set of experts; each block has its own gate and layer norms.

Built as the MoE page describes (``NormalNoiseGenerator``, ``Top2Router``,
``Experts(expert=VanillaFFN, ...)``, ``MoeLayer``), with kolossos' layers; the experts are
spread over ``parallel.moe.size`` ranks by ``Experts`` itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from kolossos.moe import (
    MOE_CONTEXT,
    Experts,
    MoeLayer,
    NormalNoiseGenerator,
    Top2Router,
)

from .util import moe_mlp_args, moe_sa_args


class VanillaSelfAttention(nn.Module):
    """Standard ViT multi-head self-attention."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_kv: int,
        attention_drop: float = 0.0,
        drop_rate: float = 0.0,
        bias: bool = True,
        dropout1: nn.Module | None = None,
        dropout2: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.d_kv = n_heads, d_kv
        self.scale = 1.0 / math.sqrt(d_kv)
        self.dense1 = nn.Linear(d_model, 3 * n_heads * d_kv, bias)
        self.atten_drop = nn.Dropout(attention_drop) if dropout1 is None else dropout1
        self.dense2 = nn.Linear(n_heads * d_kv, d_model)
        self.dropout = nn.Dropout(drop_rate) if dropout2 is None else dropout2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.dense1(x).view(b, s, 3, self.n_heads, self.d_kv).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = self.atten_drop(torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1))
        out = (att @ v).transpose(1, 2).reshape(b, s, self.n_heads * self.d_kv)
        return self.dropout(self.dense2(out))


class VanillaFFN(nn.Module):
    """Two linear layers with GELU: one expert."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: nn.Module | None = None,
        drop_rate: float = 0.0,
        bias: bool = True,
        dropout1: nn.Module | None = None,
        dropout2: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.ffn = nn.Sequential(
            nn.Linear(d_model, d_ff, bias),
            nn.GELU() if activation is None else activation,
            nn.Dropout(drop_rate) if dropout1 is None else dropout1,
            nn.Linear(d_ff, d_model, bias),
            nn.Dropout(drop_rate) if dropout2 is None else dropout2,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(x)


class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + att(norm1(x))``, then ``x + ffn(norm2(x))``."""

    def __init__(self, att: nn.Module, ffn: nn.Module, norm1: nn.Module, norm2: nn.Module):
        super().__init__()
        self.att, self.ffn, self.norm1, self.norm2 = att, ffn, norm1, norm2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.att(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class PatchEmbedding(nn.Module):
    """Image -> patch tokens, plus a class token and learned positions."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, d_model: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, d_model, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos_embed = nn.Parameter(torch.zeros(1, (img_size // patch_size) ** 2 + 1, d_model))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.pos_embed


class Widenet(nn.Module):
    """WideNet: ``depth`` blocks sharing attention, router and experts (top-2, noisy gating).

    ``capacity_factor`` (the page's keyword) is the training capacity factor, also accepted as
    ``capacity_factor_train``.
    """

    def __init__(
        self,
        num_experts: int,
        capacity_factor: float = 1.25,
        capacity_factor_eval: float = 2.0,
        drop_tks: bool = True,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        depth: int = 12,
        d_model: int = 768,
        num_heads: int = 12,
        d_kv: int = 64,
        d_ff: int = 4096,
        attention_drop: float = 0.0,
        drop_rate: float = 0.1,
        capacity_factor_train: float | None = None,
    ) -> None:
        super().__init__()
        train_factor = capacity_factor if capacity_factor_train is None else capacity_factor_train
        shared_sa = VanillaSelfAttention(**moe_sa_args(
            d_model=d_model, n_heads=num_heads, d_kv=d_kv, attention_drop=attention_drop,
            drop_rate=drop_rate))  # fmt: skip
        noisy_func = NormalNoiseGenerator(num_experts)
        shared_router = Top2Router(
            capacity_factor_train=train_factor, capacity_factor_eval=capacity_factor_eval,
            noisy_func=noisy_func, drop_tks=drop_tks)  # fmt: skip
        shared_experts = Experts(
            expert=VanillaFFN,
            num_experts=num_experts,
            **moe_mlp_args(d_model=d_model, d_ff=d_ff, drop_rate=drop_rate),
        )
        blocks = [
            TransformerLayer(
                att=shared_sa,
                ffn=MoeLayer(dim_model=d_model, num_experts=num_experts,
                             router=shared_router, experts=shared_experts),
                norm1=nn.LayerNorm(d_model, eps=1e-6),
                norm2=nn.LayerNorm(d_model, eps=1e-6),
            )
            for _ in range(depth)
        ]  # fmt: skip
        self.widenet = nn.Sequential(
            PatchEmbedding(img_size, patch_size, in_chans, d_model),
            nn.Dropout(drop_rate),
            *blocks,
            nn.LayerNorm(d_model, eps=1e-6),
        )
        self.linear = nn.Linear(d_model, num_classes)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        MOE_CONTEXT.reset_loss()  # this forward's layers add their auxiliary losses
        x = self.widenet(x)
        return self.linear(x.mean(dim=1))
