"""2.5D embeddings: :class:`Embedding2p5D` (embedding dimension split ``q * q`` ways),
:class:`VocabParallelEmbedding2p5D` (vocabulary by the row index, embedding dimension by the
column index) and :class:`PatchEmbedding2p5D` (ViT's patch projection, class token and position
embedding).

Each takes the *whole* batch, identical on every rank (token ids or images), and returns this
rank's activation block ``(B/(d*q), ..., E/q)`` — batch block ``k * q + i``, feature block ``j``
— the input :class:`~kolossos.nn.layer.parallel_2p5d.linear.Linear2p5D` expects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_2p5d._comm import (
    gather_param,
    reduce_scatter_batch,
    replicated_param,
    split_batch_2p5d,
)
from kolossos.nn.layer.parallel_2p5d._init import Initializer, check_initializer, full_init
from kolossos.nn.layer.parallel_2p5d.groups import Groups2p5D, divide
from kolossos.nn.layer.parallel_2p5d.sharding import ParallelModule2p5D

__all__ = ["Embedding2p5D", "PatchEmbedding2p5D", "VocabParallelEmbedding2p5D"]

Device = torch.device | str | None


def _dense_embedding(
    num_embeddings: int,
    embedding_dim: int,
    padding_idx: int | None,
    initializer: Initializer | None,
    device: Device,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """``nn.Embedding``'s full weight (its draws), or refilled by ``initializer``; the padding
    row is zero either way."""
    dense = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
    weight = dense.weight.detach()
    fans = {"fan_in": num_embeddings, "fan_out": embedding_dim}
    weight = full_init(weight, initializer, **fans)
    if initializer is not None and dense.padding_idx is not None:
        weight[dense.padding_idx].zero_()
    return weight


class Embedding2p5D(ParallelModule2p5D):
    """``nn.Embedding`` with the embedding dimension split into ``q * q`` pieces (piece
    ``j * q + i``; Colossal-AI's ``Embedding2p5D``). Forward gathers the column's pieces (a
    ``(num_embeddings, E/q)`` block) and looks up this rank's batch block of ids.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: embedding size (divisible by ``q * q``).
        padding_idx: as in ``nn.Embedding``.
        dtype: parameter dtype.
        weight_initializer: applied to the full weight (default: ``nn.Embedding``'s).
        groups: the tesseract's groups.
        device: parameter device.

    Example:
        >>> emb = Embedding2p5D(100, 64, groups=groups)  # doctest: +SKIP
        >>> h = emb(ids)  # ids (B, S) on every rank -> (B/(d*q), S, 64/q)  # doctest: +SKIP
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *,
        groups: Groups2p5D,
        device: Device = None,
    ) -> None:
        super().__init__()
        owner, q = type(self).__name__, groups.tesseract_dim
        divide(embedding_dim, q * q, "embedding_dim", owner)
        check_initializer(owner, "weight_initializer", weight_initializer)
        self.groups = groups
        self.num_embeddings, self.embed_dim = num_embeddings, embedding_dim
        full = _dense_embedding(
            num_embeddings, embedding_dim, padding_idx, weight_initializer, device, dtype
        )
        self.padding_idx = padding_idx if padding_idx is None else padding_idx % num_embeddings
        self.weight = self._shard(full, row_dim=1, col_dim=1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the grid column (and the depth group in backward)."""
        g = self.groups
        weight = gather_param(replicated_param(self.weight, g.dep), -1, g.col)
        return F.embedding(split_batch_2p5d(ids, g), weight, self.padding_idx)


class VocabParallelEmbedding2p5D(ParallelModule2p5D):
    """``nn.Embedding`` in ``q x q`` blocks: vocabulary rows by the row index, embedding
    columns by the column index (Colossal-AI's ``VocabParallelEmbedding2p5D``). Each rank looks
    up its depth layer's ids in its vocabulary range; the partial embeddings are summed over the
    grid column and scattered into batch blocks.

    Args:
        num_embeddings: vocabulary size (divisible by ``q``).
        embedding_dim: embedding size (divisible by ``q``).
        padding_idx: as in ``nn.Embedding``.
        dtype: parameter dtype.
        weight_initializer: applied to the full weight (default: ``nn.Embedding``'s).
        groups: the tesseract's groups.
        device: parameter device.

    Example:
        >>> emb = VocabParallelEmbedding2p5D(128, 64, groups=groups)  # doctest: +SKIP
        >>> h = emb(ids)  # (B, S) -> (B/(d*q), S, 64/q)  # doctest: +SKIP
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *,
        groups: Groups2p5D,
        device: Device = None,
    ) -> None:
        super().__init__()
        owner, q = type(self).__name__, groups.tesseract_dim
        per_rank = divide(num_embeddings, q, "num_embeddings", owner)
        self.embed_dim_per_partition = divide(embedding_dim, q, "embedding_dim", owner)
        check_initializer(owner, "weight_initializer", weight_initializer)
        self.groups = groups
        self.num_embeddings, self.embed_dim = num_embeddings, embedding_dim
        full = _dense_embedding(
            num_embeddings, embedding_dim, padding_idx, weight_initializer, device, dtype
        )
        self.padding_idx = padding_idx if padding_idx is None else padding_idx % num_embeddings
        self.vocab_start_index = groups.row_index * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.weight = self._shard(full, row_dim=0, col_dim=1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the grid column (reduce-scatter; all-gather in backward) and the
        depth group in backward."""
        g = self.groups
        if ids.shape[0] % g.batch_parts:
            raise ValueError(
                f"{type(self).__name__}: batch size {ids.shape[0]} is not divisible by "
                f"d*q={g.batch_parts}."
            )
        ids = ids.chunk(g.tesseract_dep, dim=0)[g.depth_index]
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = None
        if pad is not None and self.vocab_start_index <= pad < self.vocab_end_index:
            local_pad = pad - self.vocab_start_index
        weight = replicated_param(self.weight, g.dep)
        partial = F.embedding(local_ids, weight, local_pad)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_batch(partial, g.col)


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class PatchEmbedding2p5D(ParallelModule2p5D):
    """ViT's patch embedding (Colossal-AI's ``PatchEmbedding2p5D``): a ``patch x patch``
    convolution with stride ``patch``, flattened to tokens, a class token in front and a
    position embedding added. Every parameter's embedding dimension is split ``q * q`` ways
    (piece ``j * q + i``); forward gathers the column's pieces.

    Full (dense) parameters: ``weight (E, C, p, p)``, ``bias (E,)`` (``nn.Conv2d``'s
    initialisation), ``cls_token (1, 1, E)`` (zeros), ``pos_embed (1, N + 1, E)`` (zeros unless
    ``position_embed_initializer``).

    Args:
        img_size: image size (an int or a pair).
        patch_size: patch size (an int or a pair).
        in_chans: input channels.
        embed_size: embedding size (divisible by ``q * q``).
        flatten: must be ``True`` (tokens out); the class token needs flattened patches.
        dtype: parameter dtype.
        weight_initializer: applied to the full convolution weight.
        bias_initializer: applied to the full convolution bias.
        position_embed_initializer: applied to the full position embedding.
        groups: the tesseract's groups.
        device: parameter device.

    Example:
        >>> patch = PatchEmbedding2p5D(8, 4, 3, 16, groups=groups)  # doctest: +SKIP
        >>> tokens = patch(images)  # (B, 3, 8, 8) -> (B/(d*q), 5, 16/q)  # doctest: +SKIP
    """

    def __init__(
        self,
        img_size: int | tuple[int, int],
        patch_size: int | tuple[int, int],
        in_chans: int,
        embed_size: int,
        flatten: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        position_embed_initializer: Initializer | None = None,
        *,
        groups: Groups2p5D,
        device: Device = None,
    ) -> None:
        super().__init__()
        owner, q = type(self).__name__, groups.tesseract_dim
        if not flatten:
            raise NotImplementedError(
                f"{owner}: flatten=False is not supported (the class token is prepended to the "
                "flattened patches); use flatten=True."
            )
        divide(embed_size, q * q, "embed_size", owner)
        for name, init in (
            ("weight_initializer", weight_initializer),
            ("bias_initializer", bias_initializer),
            ("position_embed_initializer", position_embed_initializer),
        ):
            check_initializer(owner, name, init)
        self.groups = groups
        self.img_size, self.patch_size = _pair(img_size), _pair(patch_size)
        self.grid_size = (
            self.img_size[0] // self.patch_size[0],
            self.img_size[1] // self.patch_size[1],
        )
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.embed_size, self.flatten = embed_size, flatten
        conv = nn.Conv2d(
            in_chans, embed_size, self.patch_size, self.patch_size, device=device, dtype=dtype
        )
        fan_in = in_chans * self.patch_size[0] * self.patch_size[1]
        weight = full_init(
            conv.weight.detach(), weight_initializer, fan_in=fan_in, fan_out=embed_size
        )
        assert conv.bias is not None
        bias = full_init(conv.bias.detach(), bias_initializer, fan_in=fan_in)
        cls = torch.zeros(1, 1, embed_size, device=device, dtype=dtype)
        pos = torch.zeros(1, self.num_patches + 1, embed_size, device=device, dtype=dtype)
        if position_embed_initializer is not None:
            with torch.no_grad():
                position_embed_initializer(pos)
        self.weight = self._shard(weight, row_dim=0, col_dim=0)
        self.bias = self._shard(bias, row_dim=0, col_dim=0)
        self.cls_token = self._shard(cls, row_dim=2, col_dim=2)
        self.pos_embed = self._shard(pos, row_dim=2, col_dim=2)

    def _column(self, param: torch.Tensor, dim: int) -> torch.Tensor:
        g = self.groups
        return gather_param(replicated_param(param, g.dep), dim, g.col)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the grid column (and the depth group in backward)."""
        x = split_batch_2p5d(images, self.groups)
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f"{type(self).__name__}: image size {tuple(x.shape[-2:])} does not match the "
                f"model's {self.img_size}."
            )
        weight, bias = self._column(self.weight, 0), self._column(self.bias, 0)
        out = F.conv2d(x, weight, bias, stride=self.patch_size)
        out = out.flatten(2).transpose(1, 2)  # (B, C, H, W) -> (B, N, C)
        cls = self._column(self.cls_token, 2).expand(out.shape[0], -1, -1)
        return torch.cat((cls, out), dim=1) + self._column(self.pos_embed, 2)
