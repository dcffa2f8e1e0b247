"""A small Vision Transformer built from one tensor mode's layers (none, 1D, 2D, 2.5D, 3D), and
the weight copies between it and its dense (plain torch) twin.

``VisionTransformerND(config, mode)`` is patch embedding (class token, position embeddings),
``config.depth`` pre-LN blocks (multi-head self-attention, GELU MLP), a final LayerNorm and a
classifier on the class token. ``mode=None`` builds plain torch layers: the dense reference.
``'2d'`` / ``'2.5d'`` / ``'3d'`` take the layer classes of
:func:`kolossos.legacy.nn.layer.modes.mode_layers` (groups from ``gpc``; launch with the matching
``parallel.tensor``); ``'1d'`` uses column- / row-parallel linear layers over
``ParallelMode.TENSOR`` with replicated embedding, norms and head. Parameter names are the same
in every mode (``patch_embed.{weight,bias,cls_token,pos_embed}``, ``blocks.<i>.norm1``,
``blocks.<i>.attn.qkv``, ``blocks.<i>.attn.proj``, ``blocks.<i>.norm2``, ``blocks.<i>.mlp.fc1``,
``blocks.<i>.mlp.fc2``, ``norm``, ``head``), so :func:`full_state_dict` of a parallel model loads
into the dense one and :func:`load_full_state_dict` copies dense weights into the parallel one,
both exactly (gathers and slices, no arithmetic).

**Heads under 2D / 2.5D / 3D.** Every multi-dimensional mode hands the attention an activation
block ``[batch block, tokens, 3H/q]`` whose features are one *contiguous* block of the ``qkv``
output (2D: block ``j`` of the row group; 2.5D: block ``j``; 3D: the block of the swapped output
group; 1D: the rank's block), while the tokens of a sample are all local. Attention mixes tokens
of one sample and one head only, so it runs locally without communication iff each feature block
holds whole heads *with their own q, k and v*. Hence (i) ``num_heads`` must be divisible by the
number ``q`` of feature blocks, and (ii) the fused ``qkv`` output is laid out **head-major**,
``[head, (q|k|v), head_dim]``, instead of the usual ``[(q|k|v), head, head_dim]`` (with which
block ``j`` would hold the queries of some heads and the keys of others). The context
``[batch block, tokens, H/q]`` then holds heads ``j*h/q .. (j+1)*h/q`` contiguously: exactly
the feature block the ``proj`` layer takes. :func:`qkv_head_major` converts a usual fused
``qkv`` weight or bias (e.g. :class:`kolossos.models.vit.VisionTransformer`'s) to this layout.

Example (4 ranks, ``parallel=dict(tensor=dict(size=4, mode='2d'))``)::

    dense = VisionTransformerND(ViTConfig())               # the same seed on every rank
    model = VisionTransformerND(ViTConfig(), mode="2d")
    load_full_state_dict(model, dense.state_dict())        # each rank keeps its blocks
    logits = model(images)   # whole batch in; [B/2, classes] (batch block of this grid row)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.nn.layer.modes import ModeLayers, mode_layers
from kolossos.nn.layer.parallel_1d import Linear1D_Col, Linear1D_Row
from kolossos.nn.layer.parallel_1d.sharding import gather_tp_full, get_tp_spec, slice_tp_shard
from kolossos.pipeline import partition_uniform

__all__ = [
    "MODES",
    "PatchEmbedding",
    "ViTConfig",
    "VisionTransformerND",
    "full_state_dict",
    "load_full_state_dict",
    "qkv_head_major",
    "vit_criterion",
]

MODES = (None, "1d", "2d", "2.5d", "3d")
"""The tensor modes :class:`VisionTransformerND` builds (``None``: dense)."""

_FEATURE_GROUP = {
    "1d": ParallelMode.TENSOR,
    "2d": ParallelMode.PARALLEL_2D_ROW,
    "2.5d": ParallelMode.PARALLEL_2P5D_ROW,
    "3d": ParallelMode.PARALLEL_3D_OUTPUT,
}
"""A group whose size is the number of feature blocks of an activation in each mode."""


@dataclass(frozen=True)
class ViTConfig:
    """Sizes of :class:`VisionTransformerND` (defaults: tiny, for CPU tests)."""

    img_size: int = 8
    patch_size: int = 4
    in_chans: int = 3
    hidden: int = 16
    depth: int = 2
    num_heads: int = 2
    mlp_ratio: int = 2
    num_classes: int = 10
    dropout: float = 0.0
    eps: float = 1e-6


def qkv_head_major(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the rows of a fused ``qkv`` weight ``[3H, H]`` (or bias ``[3H]``) from the usual
    ``[(q|k|v), head, head_dim]`` to this module's ``[head, (q|k|v), head_dim]``.

    Example:
        >>> qkv_head_major(torch.arange(6.0), 2).tolist()  # q0 q1 k0 k1 v0 v1
        [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]
    """
    rows = tensor.shape[0]
    if rows % (3 * num_heads):
        raise ValueError(f"qkv_head_major: {rows} rows do not split into 3 x {num_heads} heads.")
    split = tensor.reshape(3, num_heads, rows // (3 * num_heads), *tensor.shape[1:])
    return split.transpose(0, 1).reshape(tensor.shape).contiguous()


class PatchEmbedding(nn.Module):
    """Dense patch embedding with the parallel ones' parameter names: ``conv2d(x, weight, bias,
    stride=patch)`` flattened to tokens, ``cls_token`` prepended, ``pos_embed`` added (both start
    at zero, as Colossal-AI's)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int) -> None:
        super().__init__()
        conv = nn.Conv2d(in_chans, embed_size, patch_size, stride=patch_size)
        assert conv.bias is not None
        self.patch_size, self.img_size = patch_size, img_size
        self.weight, self.bias = conv.weight, conv.bias
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_size))
        self.pos_embed = nn.Parameter(torch.zeros(1, (img_size // patch_size) ** 2 + 1, embed_size))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` images to ``[B, patches + 1, E]`` tokens."""
        out = F.conv2d(images, self.weight, self.bias, stride=self.patch_size)
        out = out.flatten(2).transpose(1, 2)
        out = torch.cat((self.cls_token.expand(out.shape[0], -1, -1), out), dim=1)
        return out + self.pos_embed


class _Layers:
    """The layer constructors of one mode, with one signature for all of them."""

    def __init__(self, mode: str | None) -> None:
        if mode not in MODES:
            raise ValueError(f"VisionTransformerND: mode={mode!r} must be one of {MODES}.")
        self.mode = mode
        self.nd: ModeLayers | None = mode_layers(mode)
        self.feature_parts = 1 if mode is None else gpc.get_world_size(_FEATURE_GROUP[mode])

    def linear(self, in_features: int, out_features: int, *, column: bool) -> nn.Module:
        """``column``: the first of a pair (1D: output split), else the second (1D: input split,
        output all-reduced). The ND modes need no pairing (3D layers swap their groups)."""
        if self.nd is not None:
            return self.nd.linear(in_features, out_features)
        if self.mode == "1d":
            group = gpc.get_group(ParallelMode.TENSOR)
            if column:
                return Linear1D_Col(in_features, out_features, process_group=group)
            return Linear1D_Row(in_features, out_features, process_group=group)
        return nn.Linear(in_features, out_features)

    def layer_norm(self, hidden: int, eps: float) -> nn.Module:
        if self.nd is not None:
            return self.nd.layer_norm(hidden, eps)
        return nn.LayerNorm(hidden, eps)

    def dropout(self, p: float) -> nn.Module:
        """Dropout on a residual-stream activation (ND: blocks, independent masks per rank from
        the TENSOR seed; 1D and dense: replicated, drawn from the DATA stream, alike on every
        tensor rank)."""
        return self.nd.dropout(p) if self.nd is not None else nn.Dropout(p)

    def patch_embedding(self, c: ViTConfig) -> nn.Module:
        if self.nd is not None:
            return self.nd.patch_embedding(c.img_size, c.patch_size, c.in_chans, c.hidden)
        return PatchEmbedding(c.img_size, c.patch_size, c.in_chans, c.hidden)

    def classifier(self, hidden: int, num_classes: int) -> nn.Module:
        """Whole-class logits (the batch block in ND modes)."""
        if self.nd is not None:
            return self.nd.classifier(hidden, num_classes)
        return nn.Linear(hidden, num_classes)


class Attention(nn.Module):
    """Multi-head self-attention over this rank's heads (head-major fused ``qkv``: see the
    module docstring)."""

    def __init__(self, layers: _Layers, c: ViTConfig) -> None:
        super().__init__()
        self.head_dim = c.hidden // c.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = layers.linear(c.hidden, 3 * c.hidden, column=True)
        self.proj = layers.linear(c.hidden, c.hidden, column=False)
        self.drop = layers.dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s, width = qkv.shape
        heads = width // (3 * self.head_dim)  # this rank's heads
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        attn = torch.softmax((q @ k.transpose(-2, -1)) * self.scale, dim=-1)
        ctx = (attn @ v).transpose(1, 2).reshape(b, s, heads * self.head_dim)
        return self.drop(self.proj(ctx))


class Mlp(nn.Module):
    """``fc2(gelu(fc1(x)))`` then dropout."""

    def __init__(self, layers: _Layers, c: ViTConfig) -> None:
        super().__init__()
        self.fc1 = layers.linear(c.hidden, c.mlp_ratio * c.hidden, column=True)
        self.fc2 = layers.linear(c.mlp_ratio * c.hidden, c.hidden, column=False)
        self.drop = layers.dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, layers: _Layers, c: ViTConfig) -> None:
        super().__init__()
        self.norm1 = layers.layer_norm(c.hidden, c.eps)
        self.attn = Attention(layers, c)
        self.norm2 = layers.layer_norm(c.hidden, c.eps)
        self.mlp = Mlp(layers, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformerND(nn.Module):
    """The ViT of the module docstring, or one pipeline stage of it.

    Args:
        config: the sizes.
        mode: ``None`` (dense), ``'1d'``, ``'2d'``, ``'2.5d'`` or ``'3d'`` (the launch's
            ``parallel.tensor.mode``).
        stage: this pipeline stage (blocks split uniformly; the first stage holds the patch
            embedding, the last the final norm and the head).
        num_stages: number of pipeline stages.

    Input: the whole batch of images ``[B, C, H, W]`` on every tensor rank (the ND patch
    embeddings keep their batch block), or on a later stage the previous stage's activation.
    Output: logits (ND: ``[B/…, classes]``, the batch block of the mode's loss), or a later
    stage's activation.

    Raises:
        ValueError: an unknown mode, ``hidden`` not divisible by ``num_heads``, ``num_heads``
            not divisible by the number of feature blocks, or more stages than blocks.
    """

    def __init__(
        self, config: ViTConfig, mode: str | None = None, *, stage: int = 0, num_stages: int = 1
    ) -> None:
        super().__init__()
        c, layers = config, _Layers(mode)
        if c.hidden % c.num_heads:
            raise ValueError(f"hidden={c.hidden} is not divisible by num_heads={c.num_heads}.")
        if c.num_heads % layers.feature_parts:
            raise ValueError(
                f"num_heads={c.num_heads} must be divisible by the {layers.feature_parts} feature "
                f"blocks of tensor mode {mode!r}: each rank's block must hold whole heads."
            )
        if not 0 <= stage < num_stages <= c.depth:
            raise ValueError(f"stage={stage} of num_stages={num_stages} (depth={c.depth}).")
        self.config, self.mode = config, mode
        self.first, self.last = stage == 0, stage == num_stages - 1
        ((lo, hi),) = partition_uniform(c.depth, num_stages)[stage]
        # built in forward order: 3D layers take their groups from the order they are built in
        if self.first:
            self.patch_embed = layers.patch_embedding(c)
            self.pos_drop = layers.dropout(c.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(layers, c) for i in range(lo, hi)})
        if self.last:
            self.norm = layers.layer_norm(c.hidden, c.eps)
            self.head = layers.classifier(c.hidden, c.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.pos_drop(self.patch_embed(x))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.norm(x)[:, 0])
        return x


def vit_criterion(mode: str | None) -> nn.Module:
    """The loss matching :class:`VisionTransformerND`'s logits: the ND mode's
    ``CrossEntropyLoss`` (whole targets in, the whole batch's mean out), else
    ``nn.CrossEntropyLoss``."""
    layers = mode_layers(mode)
    return layers.cross_entropy() if layers is not None else nn.CrossEntropyLoss()


def _owns_full_state(module: nn.Module) -> bool:
    return callable(getattr(module, "full_state", None)) and callable(
        getattr(module, "load_full_state", None)
    )


def _direct(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters(recurse=False))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` at full size under its (dense) name, e.g. to load into the
    dense :class:`VisionTransformerND`. COLLECTIVE over the tensor-parallel groups: call it on
    every tensor rank of the stage, in the same order."""
    state: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        params = _direct(module)
        if not params:
            continue
        dot = f"{prefix}." if prefix else ""
        if _owns_full_state(module):
            full = module.full_state()
            state.update({dot + name: full[name] for name, _ in params})
            continue
        for name, param in params:
            spec = get_tp_spec(param)
            value = param.detach() if spec is None else gather_tp_full(param.detach(), spec)
            state[dot + name] = value.clone()
    return state


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy full (dense) tensors into ``model``, each rank keeping its block; entries of
    other pipeline stages are ignored. No communication.

    Raises:
        KeyError: a parameter of ``model`` has no entry in ``state``.
    """
    with torch.no_grad():
        for prefix, module in model.named_modules():
            params = _direct(module)
            dot = f"{prefix}." if prefix else ""
            missing = [dot + name for name, _ in params if dot + name not in state]
            if missing:
                raise KeyError(f"load_full_state_dict: no entries {missing} in the state dict.")
            if params and _owns_full_state(module):
                own: dict[str, Any] = {name: state[dot + name] for name, _ in params}
                module.load_full_state(own)
                continue
            for name, param in params:
                full = state[dot + name].to(param.device, param.dtype)
                spec = get_tp_spec(param)
                if spec is not None:
                    full = slice_tp_shard(full, spec, dist.get_rank(spec.group))
                param.copy_(full)
