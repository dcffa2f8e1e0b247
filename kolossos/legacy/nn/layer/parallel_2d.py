"""Colossal-AI's 2D tensor-parallel layers (``colossalai.nn.Linear2D``, ...), with their
documented names and signatures, over the groups of the launch.

Launch with ``parallel=dict(tensor=dict(size=q*q, mode='2d'))``; every layer takes this rank's
``ParallelMode.PARALLEL_2D_ROW`` / ``PARALLEL_2D_COL`` groups from ``gpc`` and is the core layer
of :mod:`kolossos.nn.layer.parallel_2d` (same forward, blocks, ``full_state()``). Parameters are
created on the current device and initialised as the dense layer (``weight_initializer`` /
``bias_initializer``, when given, are applied to the full tensor before slicing); dropout draws
from Colossal-AI's ``seed(ParallelMode.TENSOR)`` stream.

Example (4 ranks, ``CONFIG = dict(parallel=dict(tensor=dict(size=4, mode='2d')))``)::

    from kolossos.legacy.nn.layer.parallel_2d import Linear2D, split_batch_2d
    fc = Linear2D(256, 1024)  # weight torch.Size([128, 512]) on every rank
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kolossos.legacy.context import ParallelMode
from kolossos.legacy.context.random import seed
from kolossos.legacy.core import global_context as gpc
from kolossos.nn.layer import parallel_2d as core
from kolossos.nn.layer.parallel_2d import Groups2D
from kolossos.nn.layer.parallel_2d._base import Initializer
from kolossos.utils import get_current_device

__all__ = [
    "Accuracy2D",
    "Classifier2D",
    "CrossEntropyLoss2D",
    "Dropout2D",
    "Embedding2D",
    "LayerNorm2D",
    "Linear2D",
    "PatchEmbedding2D",
    "VocabParallelClassifier2D",
    "VocabParallelCrossEntropyLoss2D",
    "VocabParallelEmbedding2D",
    "get_groups_2d",
    "reduce_by_batch_2d",
    "split_batch_2d",
]


def get_groups_2d() -> Groups2D:
    """This rank's SUMMA grid from the launch (``PARALLEL_2D_ROW`` / ``PARALLEL_2D_COL``).

    Raises:
        RuntimeError: the launch did not create 2D tensor-parallel groups.
    """
    modes = (ParallelMode.PARALLEL_2D_ROW, ParallelMode.PARALLEL_2D_COL)
    if not all(gpc.is_initialized(mode) for mode in modes):
        raise RuntimeError(
            "2D tensor-parallel layers need the 2D process groups: launch with "
            "config=dict(parallel=dict(tensor=dict(size=4, mode='2d'))) (size a square) first."
        )
    return Groups2D(row=gpc.get_group(modes[0]), col=gpc.get_group(modes[1]))


def _tensor_seed() -> Any:
    return seed(ParallelMode.TENSOR)


def split_batch_2d(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This rank's batch block ``chunk(input_, q, dim)[rank in PARALLEL_2D_COL]``."""
    return core.split_batch_2d(input_, get_groups_2d(), dim)


def reduce_by_batch_2d(input_: torch.Tensor, reduce_mean: bool = False) -> torch.Tensor:
    """Sum (or average) a per-batch-block value over ``PARALLEL_2D_COL``. COLLECTIVE."""
    return core.reduce_by_batch_2d(input_, get_groups_2d(), reduce_mean)


class Linear2D(core.Linear2D):
    """Colossal-AI's ``Linear2D(in_features, out_features, bias=True, dtype=None,
    skip_bias_add=False, weight_initializer=..., bias_initializer=...)``; see
    :class:`kolossos.nn.layer.parallel_2d.Linear2D`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        skip_bias_add: bool = False,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            bias,
            dtype,
            skip_bias_add,
            weight_initializer,
            bias_initializer,
            groups=get_groups_2d(),
            device=get_current_device(),
        )


class LayerNorm2D(core.LayerNorm2D):
    """Colossal-AI's ``LayerNorm2D(normalized_shape, eps=1e-05, bias=True, dtype=None)``."""

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-05,
        bias: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, bias, dtype, groups=get_groups_2d(), device=get_current_device()
        )


class Classifier2D(core.Classifier2D):
    """Colossal-AI's ``Classifier2D(in_features, num_classes, weight=None, bias=True,
    dtype=None, weight_initializer=..., bias_initializer=...)``."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
    ) -> None:
        super().__init__(
            in_features,
            num_classes,
            weight,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            groups=get_groups_2d(),
            device=get_current_device(),
        )


class VocabParallelClassifier2D(core.VocabParallelClassifier2D):
    """Colossal-AI's ``VocabParallelClassifier2D(in_features, num_classes, weight=None,
    bias=True, dtype=None, weight_initializer=..., bias_initializer=...)``."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
    ) -> None:
        super().__init__(
            in_features,
            num_classes,
            weight,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            groups=get_groups_2d(),
            device=get_current_device(),
        )


class Embedding2D(core.Embedding2D):
    """Colossal-AI's ``Embedding2D(num_embeddings, embedding_dim, padding_idx=None, dtype=None,
    weight_initializer=..., *args, **kwargs)``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            dtype,
            weight_initializer,
            *args,
            groups=get_groups_2d(),
            device=get_current_device(),
            **kwargs,
        )


class VocabParallelEmbedding2D(core.VocabParallelEmbedding2D):
    """Colossal-AI's ``VocabParallelEmbedding2D(num_embeddings, embedding_dim,
    padding_idx=None, dtype=None, weight_initializer=..., *args, **kwargs)``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            dtype,
            weight_initializer,
            *args,
            groups=get_groups_2d(),
            device=get_current_device(),
            **kwargs,
        )


class PatchEmbedding2D(core.PatchEmbedding2D):
    """Colossal-AI's ``PatchEmbedding2D(img_size, patch_size, in_chans, embed_size,
    flatten=True, dtype=None, weight_initializer=..., bias_initializer=...,
    position_embed_initializer=...)``."""

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embed_size: int,
        flatten: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        position_embed_initializer: Initializer | None = None,
    ) -> None:
        super().__init__(
            img_size,
            patch_size,
            in_chans,
            embed_size,
            flatten,
            dtype,
            weight_initializer,
            bias_initializer,
            position_embed_initializer,
            groups=get_groups_2d(),
            device=get_current_device(),
        )


class Dropout2D(core.Dropout2D):
    """Dropout on 2D blocks drawing from ``seed(ParallelMode.TENSOR)`` (what ``col_nn.Dropout``
    does in Colossal-AI's 2D mode)."""

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__(p, inplace, groups=get_groups_2d(), rng_context=_tensor_seed)


class CrossEntropyLoss2D(core.CrossEntropyLoss2D):
    """Colossal-AI's ``CrossEntropyLoss2D(reduction=True, *args, **kwargs)``."""

    def __init__(self, reduction: bool = True, *args: Any, **kwargs: Any) -> None:
        super().__init__(reduction, *args, groups=get_groups_2d(), **kwargs)


class VocabParallelCrossEntropyLoss2D(core.VocabParallelCrossEntropyLoss2D):
    """Colossal-AI's ``VocabParallelCrossEntropyLoss2D(reduction=True)``."""

    def __init__(self, reduction: bool = True) -> None:
        super().__init__(reduction, groups=get_groups_2d())


class Accuracy2D(core.Accuracy2D):
    """Colossal-AI's ``Accuracy2D()``: correct predictions of the whole batch."""

    def __init__(self) -> None:
        super().__init__(groups=get_groups_2d())
