"""3D embeddings: :class:`Embedding3D` (features split), :class:`VocabParallelEmbedding3D`
(vocabulary and features split) and the ViT :class:`PatchEmbedding3D`.

Each takes the *whole* batch (token ids or images) and returns this rank's
``(batch/q**2, ..., features/q)`` block, as Colossal-AI's do (the batch is split inside).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d._comm import (
    gather_seq_reduce_scatter_grad,
    reduce_scatter_seq_gather_grad,
)
from kolossos.nn.layer.parallel_3d._base import Initializer, ParallelModule3D, Splits
from kolossos.nn.layer.parallel_3d._comm import split_batch_3d, split_tensor_3d, sync_grad
from kolossos.nn.layer.parallel_3d.groups import Groups3D, divide_3d

__all__ = ["Embedding3D", "PatchEmbedding3D", "VocabParallelEmbedding3D"]


def _no_options(owner: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse ``F.embedding``'s extra options (``max_norm`` would renormalise with a partial
    norm, ``scale_grad_by_freq`` would count a batch shard, ``sparse`` is not supported)."""
    given = {k: v for k, v in kwargs.items() if v not in (None, False, 2.0)}
    if any(a not in (None, False, 2.0) for a in args) or given:
        raise NotImplementedError(
            f"{owner}: F.embedding options {args or ''}{given or ''} are not supported under 3D "
            "tensor parallelism; build the embedding without them."
        )


class _Embedding3DBase(ParallelModule3D):
    weight_splits: Splits

    def _build_weight(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None,
        weight: torch.Tensor | None,
        weight_initializer: Initializer | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.embed_dim = embedding_dim  # Colossal-AI's attribute name
        self.padding_idx = padding_idx
        shape = (num_embeddings, embedding_dim)
        if weight_initializer is not None:
            if weight is not None:
                raise ValueError(
                    f"{type(self).__name__}: weight and weight_initializer both given."
                )
            weight = torch.empty(shape, device=device, dtype=dtype)
            with torch.no_grad():
                weight_initializer(weight, fan_in=num_embeddings, fan_out=embedding_dim)
                if padding_idx is not None:  # the padding row is zero, as in nn.Embedding
                    weight[padding_idx] = 0
        if weight is None:  # the dense layer's draws: same seed, same full matrix
            weight = nn.Embedding(*shape, padding_idx, device=device, dtype=dtype).weight
        if tuple(weight.shape) != shape:
            raise ValueError(
                f"{type(self).__name__}: weight of shape {tuple(weight.shape)} does not match "
                f"({num_embeddings}, {embedding_dim})."
            )
        self.weight = self._shard(
            weight.detach().to(device=device, dtype=dtype), self.weight_splits
        )

    @classmethod
    def from_native_module(cls, module: nn.Module, groups: Groups3D, **kwargs: Any) -> Any:
        """Build from an ``nn.Embedding``, slicing its weight (left unchanged)."""
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"expected an nn.Embedding, got {type(module).__name__}.")
        _no_options(cls.__name__, (), {"max_norm": module.max_norm, "sparse": module.sparse})
        return cls(
            module.num_embeddings,
            module.embedding_dim,
            module.padding_idx,
            groups=groups,
            weight=module.weight,
            **kwargs,
        )

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, depth={self.depth}"


class Embedding3D(_Embedding3DBase):
    """Embedding with the features split by the output group and the table repeated on the
    input x weight plane (which sums its gradient).

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: embedding size (divisible by ``q``).
        padding_idx: as in ``nn.Embedding``.
        dtype: parameter dtype.
        weight_initializer: ``init(block, fan_in=vocab, fan_out=dim)``; default:
            ``nn.Embedding``'s initialisation of the full table (the dense table, sliced).
        args: ``F.embedding``'s further options; not supported (``NotImplementedError``).
        groups: the groups of the output's layout (keyword-only).
        weight: the full ``(vocab, dim)`` table to slice.
        device: where the table lives.
        kwargs: ``F.embedding``'s options by name; not supported.

    Example:
        >>> emb = Embedding3D(100, 64, groups=groups)  # doctest: +SKIP
        >>> emb(ids).shape  # ids (16, 8), q = 2  # doctest: +SKIP
        torch.Size([4, 8, 32])
    """

    weight_splits = ((1, "output"),)

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *args: Any,
        groups: Groups3D,
        weight: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        _no_options(type(self).__name__, args, kwargs)
        q = self._init_groups(groups).depth
        divide_3d(embedding_dim, q, "embedding_dim")
        self._build_weight(
            num_embeddings, embedding_dim, padding_idx, weight, weight_initializer, device, dtype
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        ids = split_batch_3d(input_, self.groups)
        weight = sync_grad(self.weight, self.groups.input_x_weight)
        return F.embedding(ids, weight, self.padding_idx)


class VocabParallelEmbedding3D(_Embedding3DBase):
    """Embedding with the vocabulary split by the input and weight groups (``q**2`` row blocks,
    block ``i * q + w``) and the features by the output group: every element is held once.

    The rows of the weight group are all-gathered (their gradient reduce-scattered), each rank
    looks up the ids of its batch rows (split by the weight group) that fall in its vocabulary
    range, and the partial embeddings are reduce-scattered over the input group.

    Args: as :class:`Embedding3D` (``num_embeddings`` divisible by ``q**2``).

    Example:
        >>> emb = VocabParallelEmbedding3D(128, 64, groups=groups)  # doctest: +SKIP
    """

    weight_splits = ((0, "input"), (0, "weight"), (1, "output"))

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *args: Any,
        groups: Groups3D,
        weight: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        _no_options(type(self).__name__, args, kwargs)
        g = self._init_groups(groups)
        divide_3d(num_embeddings, g.depth**2, "num_embeddings")
        divide_3d(embedding_dim, g.depth, "embedding_dim")
        per_input_rank = num_embeddings // g.depth
        self.vocab_start_index = g.input_rank * per_input_rank
        self.vocab_end_index = self.vocab_start_index + per_input_rank
        self._build_weight(
            num_embeddings, embedding_dim, padding_idx, weight, weight_initializer, device, dtype
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if input_.size(0) % self.depth**2:
            raise ValueError(
                f"VocabParallelEmbedding3D: batch size {input_.size(0)} is not divisible by "
                f"q**2={self.depth**2}; use a batch size divisible by q**2."
            )
        ids = split_tensor_3d(input_, 0, self.groups.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = None
        if pad is not None and self.vocab_start_index <= pad < self.vocab_end_index:
            local_pad = pad - self.vocab_start_index
        rows = gather_seq_reduce_scatter_grad(self.weight, self.groups.weight, 0)  # SYNC POINT
        out = F.embedding(local_ids, rows, local_pad).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq_gather_grad(out, self.groups.input, 0)  # SYNC POINT


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class PatchEmbedding3D(ParallelModule3D):
    """ViT patch embedding (a strided convolution, a class token and position embeddings) with
    the embedding features split by the output group; every parameter is repeated on the input
    x weight plane, which sums its gradients.

    The dense equivalent: ``conv2d(x, weight, bias, stride=patch)``, flattened to
    ``(batch, patches, embed)``, the class token prepended and ``pos_embed`` added; parameter
    names ``weight, bias, cls_token, pos_embed``.

    Args:
        img_size: image size (int or pair).
        patch_size: patch size (int or pair).
        in_chans: input channels.
        embed_size: embedding size (divisible by ``q``).
        flatten: flatten the patches to a sequence.
        dtype: parameter dtype.
        weight_initializer: ``init(block, fan_in=in_chans*ph*pw, fan_out=embed)``; default:
            ``nn.Conv2d``'s initialisation of the full kernel.
        bias_initializer: ``init(block, fan_in=...)``; default: ``nn.Conv2d``'s.
        position_embed_initializer: ``init(block)`` of the position embeddings; default zeros
            (the class token starts at zero, as in Colossal-AI).
        groups: the groups of the output's layout (keyword-only).
        device: where the parameters live.

    Example:
        >>> patches = PatchEmbedding3D(8, 4, 3, 64, groups=groups)  # doctest: +SKIP
        >>> patches(images).shape  # images (16, 3, 8, 8), q = 2  # doctest: +SKIP
        torch.Size([4, 5, 32])
    """

    weight: nn.Parameter
    bias: nn.Parameter
    cls_token: nn.Parameter
    pos_embed: nn.Parameter

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
        groups: Groups3D,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        q = self._init_groups(groups).depth
        divide_3d(embed_size, q, "embed_size")
        self.img_size, self.patch_size = _pair(img_size), _pair(patch_size)
        self.grid_size = tuple(i // p for i, p in zip(self.img_size, self.patch_size, strict=True))
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.embed_size, self.flatten = embed_size, flatten
        kernel = (embed_size, in_chans, *self.patch_size)
        fan_in = in_chans * self.patch_size[0] * self.patch_size[1]
        conv = nn.Conv2d(in_chans, embed_size, self.patch_size, device=device, dtype=dtype)
        assert conv.bias is not None
        pieces: dict[str, tuple[tuple[int, ...], Splits, Initializer | None, torch.Tensor]] = {
            "weight": (kernel, ((0, "output"),), weight_initializer, conv.weight),
            "bias": ((embed_size,), ((0, "output"),), bias_initializer, conv.bias),
            "cls_token": (
                (1, 1, embed_size),
                ((2, "output"),),
                None,
                torch.zeros(1, 1, embed_size),
            ),
            "pos_embed": (
                (1, self.num_patches + 1, embed_size),
                ((2, "output"),),
                position_embed_initializer,
                torch.zeros(1, self.num_patches + 1, embed_size),
            ),
        }
        fans = {"weight": {"fan_in": fan_in, "fan_out": embed_size}, "bias": {"fan_in": fan_in}}
        for name, (shape, splits, init, default) in pieces.items():
            if init is None:
                param = self._shard(default.detach().to(device=device, dtype=dtype), splits)
            else:
                param = self._initialized(shape, splits, init, device, dtype, **fans.get(name, {}))
            self.register_parameter(name, param)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        group = self.groups.input_x_weight
        x = split_batch_3d(input_, self.groups)
        weight, bias = sync_grad(self.weight, group), sync_grad(self.bias, group)
        out = F.conv2d(x, weight, bias, stride=self.patch_size)
        if self.flatten:
            out = out.flatten(2).transpose(1, 2)  # (B, C, H, W) -> (B, patches, C)
        cls_token = sync_grad(self.cls_token, group).expand(out.shape[0], -1, -1)
        out = torch.cat((cls_token, out), dim=1)
        return out + sync_grad(self.pos_embed, group)
