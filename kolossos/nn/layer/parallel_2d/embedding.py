"""2D embeddings: :class:`Embedding2D` (features split), :class:`VocabParallelEmbedding2D`
(vocabulary and features split) and :class:`PatchEmbedding2D` (ViT patches).

All three take the *whole* input (token ids or images, the same on every rank) and return the
2D block ``[B/q, ..., D/q]`` (batch block ``i``, feature block ``j``) that :class:`Linear2D`
and :class:`LayerNorm2D` take.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_2d._base import Initializer, ParallelModule2D, init_full
from kolossos.nn.layer.parallel_2d._comm import gather_weight_2d, reduce_scatter_2d, split_batch_2d
from kolossos.nn.layer.parallel_2d.grid import Groups2D, check_divisible

__all__ = ["Embedding2D", "PatchEmbedding2D", "VocabParallelEmbedding2D"]

_OPTIONS = ("max_norm", "norm_type", "scale_grad_by_freq", "sparse")
_DEFAULTS: dict[str, Any] = {
    "max_norm": None,
    "norm_type": 2.0,
    "scale_grad_by_freq": False,
    "sparse": False,
}


def _reject_options(owner: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``F.embedding``'s options (Colossal-AI's ``*args, **kwargs``): only their defaults are
    supported — a shard cannot renormalise (``max_norm``), count ids over the whole batch
    (``scale_grad_by_freq``) or give sparse gradients.

    Raises:
        TypeError: an unknown option.
        NotImplementedError: a non-default value.
    """
    if len(args) > len(_OPTIONS):
        raise TypeError(f"{owner}: too many positional options {args!r}.")
    options = dict(zip(_OPTIONS, args, strict=False))
    for key, value in kwargs.items():
        if key not in _OPTIONS or key in options:
            raise TypeError(f"{owner}: unexpected or repeated option {key}={value!r}.")
        options[key] = value
    for key, value in options.items():
        if key != "norm_type" and value != _DEFAULTS[key]:
            raise NotImplementedError(
                f"{owner}: {key}={value!r} is not supported under 2D tensor parallelism; build "
                f"the embedding without {key}."
            )


def _full_embedding(
    num_embeddings: int,
    embedding_dim: int,
    padding_idx: int | None,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    initializer: Initializer | None,
) -> torch.Tensor:
    weight = nn.Embedding(
        num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype
    ).weight.detach()
    init_full(weight, initializer, fan_in=num_embeddings, fan_out=embedding_dim)
    if padding_idx is not None and initializer is not None:
        weight[padding_idx].zero_()
    return weight


class Embedding2D(ParallelModule2D):
    """Embedding with the embedding dimension split over the whole grid: weight
    ``[V, D/q²]`` (piece ``i`` of feature block ``j``), all-gathered over the column group.

    Args:
        num_embeddings: vocabulary size ``V``.
        embedding_dim: ``D`` (divisible by ``q²``).
        padding_idx: as in ``nn.Embedding``.
        dtype: parameter dtype.
        weight_initializer: ``init(full_weight, fan_in=V, fan_out=D)``; ``None``:
            ``nn.Embedding``'s.
        args: ``F.embedding``'s options (defaults only).
        groups: the grid.
        device: where the weight lives.
        kwargs: ``F.embedding``'s options by name (defaults only).

    Example:
        >>> emb = Embedding2D(100, 64, groups=groups)  # doctest: +SKIP
        >>> emb(ids).shape  # ids [8, 16] on every rank, q = 2  # doctest: +SKIP
        torch.Size([4, 16, 32])
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *args: Any,
        groups: Groups2D,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        _reject_options(name, args, kwargs)
        self._init_groups(groups)
        q = self.groups.q
        check_divisible(name, "embedding_dim", embedding_dim, q * q)
        self.num_embeddings, self.embed_dim, self.padding_idx = (
            num_embeddings,
            embedding_dim,
            padding_idx,
        )
        full = _full_embedding(
            num_embeddings, embedding_dim, padding_idx, device, dtype, weight_initializer
        )
        self.weight = self._block(full, ((1, "row"), (1, "col")))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``: the whole batch (the same on every rank). COLLECTIVE."""
        ids = split_batch_2d(input_ids, self.groups)
        weight = gather_weight_2d(self.weight, self.groups, dim=-1)  # [V, D/q], block j
        return F.embedding(ids, weight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embed_dim}, q={self.groups.q}"


class VocabParallelEmbedding2D(ParallelModule2D):
    """Embedding with the vocabulary split over grid rows and the features over grid columns:
    weight ``[V/q, D/q]`` block ``(i, j)``. Each rank looks up the ids of its vocabulary range
    (others give zeros) for the whole batch; the partial embeddings are summed over the column
    group and scattered by batch block (one reduce-scatter).

    Args:
        num_embeddings: vocabulary size ``V`` (divisible by ``q``).
        embedding_dim: ``D`` (divisible by ``q``).
        padding_idx: as in ``nn.Embedding``.
        dtype: parameter dtype.
        weight_initializer: ``init(full_weight, fan_in=V, fan_out=D)``; ``None``:
            ``nn.Embedding``'s.
        args: ``F.embedding``'s options (defaults only).
        groups: the grid.
        device: where the weight lives.
        kwargs: ``F.embedding``'s options by name (defaults only).

    Example:
        >>> emb = VocabParallelEmbedding2D(128, 64, groups=groups)  # doctest: +SKIP
        >>> emb(ids).shape  # ids [8, 16], q = 2  # doctest: +SKIP
        torch.Size([4, 16, 32])
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *args: Any,
        groups: Groups2D,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        _reject_options(name, args, kwargs)
        self._init_groups(groups)
        q = self.groups.q
        per_rank = check_divisible(name, "num_embeddings", num_embeddings, q)
        check_divisible(name, "embedding_dim", embedding_dim, q)
        self.num_embeddings, self.embed_dim, self.padding_idx = (
            num_embeddings,
            embedding_dim,
            padding_idx,
        )
        self.vocab_start_index = self.groups.row_index * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        local_pad = None
        if padding_idx is not None and self.vocab_start_index <= padding_idx < self.vocab_end_index:
            local_pad = padding_idx - self.vocab_start_index
        self._local_padding_idx = local_pad
        full = _full_embedding(
            num_embeddings, embedding_dim, padding_idx, device, dtype, weight_initializer
        )
        self.weight = self._block(full, ((0, "col"), (1, "row")))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``: the whole batch (the same on every rank; batch divisible by ``q``).
        COLLECTIVE over the column group."""
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_2d(out, self.groups, dim=0)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embed_dim}, rows=[{self.vocab_start_index}, "
            f"{self.vocab_end_index}), q={self.groups.q}"
        )


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class PatchEmbedding2D(ParallelModule2D):
    """ViT patch embedding (conv ``patch x patch`` with stride ``patch``, a class token and
    position embeddings) returning the 2D block ``[B/q, N + 1, E/q]``.

    The convolution weight ``[E, C, p, p]``, its bias ``[E]``, ``cls_token [1, 1, E]`` and
    ``pos_embed [1, N + 1, E]`` are split along ``E`` like a bias (piece ``i`` of block ``j``).

    Args:
        img_size: image side (or ``(height, width)``).
        patch_size: patch side (or pair).
        in_chans: image channels ``C``.
        embed_size: ``E`` (divisible by ``q²``).
        flatten: return ``[B/q, N + 1, E/q]`` (``False``: the conv output ``[B/q, E/q, h, w]``,
            without the class token and position embeddings, as Colossal-AI does).
        dtype: parameter dtype.
        weight_initializer: ``init(full_weight, fan_in=C*p*p, fan_out=E)``; ``None``:
            ``nn.Conv2d``'s.
        bias_initializer: ``init(full_bias, fan_in=C*p*p)``; ``None``: ``nn.Conv2d``'s.
        position_embed_initializer: ``init(full_pos_embed)``; ``None``: zeros.
        groups: the grid.
        device: where the parameters live.

    Example:
        >>> patch = PatchEmbedding2D(8, 4, 3, 32, groups=groups)  # doctest: +SKIP
        >>> patch(images).shape  # images [4, 3, 8, 8], q = 2  # doctest: +SKIP
        torch.Size([2, 5, 16])
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
        groups: Groups2D,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self._init_groups(groups)
        check_divisible(name, "embed_size", embed_size, self.groups.q**2)
        self.img_size, self.patch_size = _pair(img_size), _pair(patch_size)
        self.grid_size = (
            self.img_size[0] // self.patch_size[0],
            self.img_size[1] // self.patch_size[1],
        )
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.flatten, self.embed_size = flatten, embed_size
        conv = nn.Conv2d(
            in_chans,
            embed_size,
            self.patch_size,
            stride=self.patch_size,
            device=device,
            dtype=dtype,
        )
        fan_in = in_chans * self.patch_size[0] * self.patch_size[1]
        weight = init_full(
            conv.weight.detach(), weight_initializer, fan_in=fan_in, fan_out=embed_size
        )
        assert conv.bias is not None
        bias = init_full(conv.bias.detach(), bias_initializer, fan_in=fan_in)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        pos = torch.zeros(1, self.num_patches + 1, embed_size, **factory)
        if position_embed_initializer is not None:
            init_full(pos, position_embed_initializer)
        feature_splits = ((0, "row"), (0, "col"))
        self.weight = self._block(weight, feature_splits)
        self.bias = self._block(bias, feature_splits)
        token_splits = ((2, "row"), (2, "col"))
        self.cls_token = self._block(torch.zeros(1, 1, embed_size, **factory), token_splits)
        self.pos_embed = self._block(pos, token_splits)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images``: the whole batch ``[B, C, H, W]`` (the same on every rank). COLLECTIVE."""
        x = split_batch_2d(images, self.groups)
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f"{type(self).__name__}: images of size {tuple(x.shape[-2:])}, the layer was "
                f"built for {self.img_size}; resize the input or rebuild the layer."
            )
        weight = gather_weight_2d(self.weight, self.groups, dim=0)
        bias = gather_weight_2d(self.bias, self.groups, dim=0)
        out = F.conv2d(x, weight, bias, stride=self.patch_size)
        if not self.flatten:
            return out
        out = out.flatten(2).transpose(1, 2)  # [B/q, N, E/q]
        cls_token = gather_weight_2d(self.cls_token, self.groups, dim=-1)
        pos_embed = gather_weight_2d(self.pos_embed, self.groups, dim=-1)
        out = torch.cat((cls_token.expand(out.shape[0], -1, -1), out), dim=1)
        return out + pos_embed

    def extra_repr(self) -> str:
        return (
            f"img_size={self.img_size}, patch_size={self.patch_size}, "
            f"embed_size={self.embed_size}, q={self.groups.q}"
        )
