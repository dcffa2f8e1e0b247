"""Vision Transformer (Dosovitskiy et al., 2020): patch embedding, class token, pre-norm blocks.

State-dict keys follow the common layout (``patch_embed.proj``, ``cls_token``, ``pos_embed``,
``blocks.<i>.norm1``, ``blocks.<i>.attn.qkv``, ``blocks.<i>.attn.proj``, ``blocks.<i>.norm2``,
``blocks.<i>.mlp.fc1``, ``blocks.<i>.mlp.fc2``, ``norm``, ``head``). The fused ``qkv`` and the
separate ``proj`` linear layers are what column/row tensor-parallel plans shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "Mlp", "PatchEmbed", "TransformerBlock", "VisionTransformer"]
__all__ += ["vit_base", "vit_small", "vit_tiny"]


class PatchEmbed(nn.Module):
    """Cut an image into non-overlapping patches and project each to ``dim`` (a strided conv).

    Args:
        image_size: height and width of the (square) input.
        patch_size: side of a patch; must divide ``image_size``.
        in_channels: channels of the input.
        dim: embedding width.
    """

    def __init__(self, image_size: int, patch_size: int, in_channels: int, dim: int) -> None:
        super().__init__()
        self.image_size = image_size
        self.num_patches = (image_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` images to ``(B, num_patches, dim)`` tokens."""
        if x.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"input images are {tuple(x.shape[-2:])} but the model was built for "
                f"image_size={self.image_size}; resize the inputs or build the model with "
                f"image_size={x.shape[-1]}."
            )
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with a fused ``qkv`` projection, computed by torch's SDPA.

    Args:
        dim: token width; must be divisible by ``heads``.
        heads: number of attention heads.
        attention_dropout: dropout on the attention probabilities (training only).
        dropout: dropout after the output projection.
    """

    def __init__(self, dim: int, heads: int, attention_dropout: float, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, N, dim)`` to ``(B, N, dim)``."""
        b, n, dim = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        p = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, dim)))


class Mlp(nn.Module):
    """Two linear layers with GELU between (the transformer feed-forward block)."""

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., dim)`` to ``(..., dim)``."""
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class TransformerBlock(nn.Module):
    """A pre-norm encoder block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(
        self, dim: int, heads: int, mlp_ratio: float, dropout: float, attention_dropout: float
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, attention_dropout, dropout)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, N, dim)`` to ``(B, N, dim)``."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """A ViT classifier: patch embedding, class token, learned positions, blocks, norm, linear head.

    Weights are drawn from torch's global RNG (truncated normal, std 0.02, for the linear layers,
    the class token and the position embedding; zero biases), so ``torch.manual_seed(s)`` before
    construction makes them reproducible.

    Args:
        image_size: side of the square input images.
        patch_size: side of a patch; must divide ``image_size``.
        num_classes: outputs of the head.
        dim: token width.
        depth: number of transformer blocks.
        heads: attention heads; must divide ``dim``.
        mlp_ratio: hidden width of the feed-forward block relative to ``dim``.
        dropout: dropout after the embeddings, attention projection and MLP layers.
        attention_dropout: dropout on the attention probabilities.
        in_channels: channels of the input images.

    Raises:
        ValueError: a size is not positive or does not divide as stated above.

    Example:
        >>> vit = VisionTransformer(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2,
        ...                         heads=4)
        >>> vit(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        num_classes: int = 1000,
        dim: int = 768,
        depth: int = 12,
        heads: int = 12,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        *,
        attention_dropout: float = 0.0,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        sizes = dict(image_size=image_size, patch_size=patch_size, num_classes=num_classes, dim=dim)
        _validate(dict(sizes, depth=depth, heads=heads, in_channels=in_channels), mlp_ratio)
        self.patch_embed = PatchEmbed(image_size, patch_size, in_channels, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, dim))
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(
                TransformerBlock(dim, heads, mlp_ratio, dropout, attention_dropout)
                for _ in range(depth)
            )
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for module in self.modules():
            # The patch projection is a linear map of the flattened patch: initialise it like one.
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised class-token features: ``(B, dim)``."""
        tokens = self.patch_embed(x)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        tokens = self.pos_drop(torch.cat([cls, tokens], dim=1) + self.pos_embed)
        return self.norm(self.blocks(tokens))[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``(B, num_classes)`` for images ``(B, C, image_size, image_size)``."""
        return self.head(self.forward_features(x))


def _validate(sizes: dict[str, int], mlp_ratio: float) -> None:
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1.")
    image_size, patch_size = sizes["image_size"], sizes["patch_size"]
    if image_size % patch_size:
        raise ValueError(
            f"patch_size={patch_size} must divide image_size={image_size}; pick e.g. "
            f"patch_size=16 for 224 or patch_size=4 for 32."
        )
    dim, heads = sizes["dim"], sizes["heads"]
    if dim % heads:
        raise ValueError(f"heads={heads} must divide dim={dim}; e.g. dim=192 with heads=3.")
    if mlp_ratio <= 0:
        raise ValueError(f"mlp_ratio={mlp_ratio} must be > 0 (4.0 is standard).")


def vit_tiny(
    num_classes: int = 1000,
    *,
    image_size: int = 224,
    patch_size: int = 16,
    dropout: float = 0.0,
) -> VisionTransformer:
    """ViT-Ti: dim 192, depth 12, 3 heads (5,717,416 parameters at 224/16, 1000 classes).

    Args:
        num_classes: outputs of the head.
        image_size: side of the square input images.
        patch_size: side of a patch; must divide ``image_size`` (e.g. 4 for CIFAR's 32x32).
        dropout: dropout after embeddings, attention projection and MLP layers (build a
            :class:`VisionTransformer` directly for attention dropout or other channel counts).

    Example:
        >>> vit_tiny(num_classes=10, image_size=32, patch_size=4).pos_embed.shape
        torch.Size([1, 65, 192])
    """
    return VisionTransformer(image_size, patch_size, num_classes, 192, 12, 3, dropout=dropout)


def vit_small(
    num_classes: int = 1000,
    *,
    image_size: int = 224,
    patch_size: int = 16,
    dropout: float = 0.0,
) -> VisionTransformer:
    """ViT-S: dim 384, depth 12, 6 heads (22,050,664 parameters at 224/16, 1000 classes).

    Args: as :func:`vit_tiny`.

    Example:
        >>> with torch.device("meta"):  # shapes only, no memory or init cost
        ...     model = vit_small()
        >>> sum(p.numel() for p in model.parameters())
        22050664
    """
    return VisionTransformer(image_size, patch_size, num_classes, 384, 12, 6, dropout=dropout)


def vit_base(
    num_classes: int = 1000,
    *,
    image_size: int = 224,
    patch_size: int = 16,
    dropout: float = 0.0,
) -> VisionTransformer:
    """ViT-B: dim 768, depth 12, 12 heads (86,567,656 parameters at 224/16, 1000 classes).

    Args: as :func:`vit_tiny`.

    Example:
        >>> with torch.device("meta"):
        ...     model = vit_base()
        >>> sum(p.numel() for p in model.parameters())
        86567656
    """
    return VisionTransformer(image_size, patch_size, num_classes, 768, 12, 12, dropout=dropout)
