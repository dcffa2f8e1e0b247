"""The few pieces of ``timm.models.vision_transformer`` the tutorial uses, with timm's names and
signatures, for machines without timm: ``PatchEmbed``, ``Block``, ``trunc_normal_`` and
``_init_vit_weights``. ``train.py`` imports timm's module when it is installed and this one
otherwise (timm's weights initialisation differs in details that do not matter here)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

__all__ = ["Block", "PatchEmbed", "_init_vit_weights", "trunc_normal_"]


def trunc_normal_(tensor: torch.Tensor, std: float = 1.0) -> torch.Tensor:
    """Truncated normal init (two standard deviations), as timm's."""
    return nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)


def _init_vit_weights(module: nn.Module) -> None:
    """timm's ViT init: truncated-normal linear weights (std .02), zero biases, unit LayerNorm."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class PatchEmbed(nn.Module):
    """Image to patch tokens: ``(B, C, H, W)`` to ``(B, num_patches, embed_dim)``."""

    def __init__(
        self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768
    ) -> None:
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, attn_drop: float, drop: float):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = (
            self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        )
        attn = self.attn_drop(((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1))
        return self.proj_drop(self.proj((attn @ v).transpose(1, 2).reshape(b, n, c)))


class Block(nn.Module):
    """A pre-norm transformer block with timm's constructor arguments (``drop_path`` must be 0:
    stochastic depth is not part of this stand-in)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        act_layer: Callable[[], nn.Module] = nn.GELU,
        norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
    ) -> None:
        super().__init__()
        if drop_path:
            raise NotImplementedError(f"drop_path={drop_path}: install timm for stochastic depth.")
        hidden = int(dim * mlp_ratio)
        self.norm1 = norm_layer(dim)
        self.attn = _Attention(dim, num_heads, qkv_bias, attn_drop, drop)
        self.norm2 = norm_layer(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), act_layer(), nn.Dropout(drop),
                                 nn.Linear(hidden, dim), nn.Dropout(drop))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
