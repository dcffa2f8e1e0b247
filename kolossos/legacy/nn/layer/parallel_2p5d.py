"""Colossal-AI's 2.5D (Tesseract) tensor-parallel layers (``colossalai.nn.Linear2p5D``, ...),
with their documented names and signatures, over the groups of the launch.

Launch with ``parallel=dict(tensor=dict(size=q*q*d, mode='2.5d', depth=d))``; every layer takes
this rank's ``ParallelMode.PARALLEL_2P5D_ROW`` / ``COL`` / ``DEP`` / ``XZ`` (and ``TENSOR``)
groups from ``gpc`` and is the core layer of :mod:`kolossos.nn.layer.parallel_2p5d` (same
forward, blocks, ``full_state()``). Parameters are created on the current device and initialised
as the dense layer (``weight_initializer`` / ``bias_initializer``, when given, are applied to the
full tensor before slicing); dropout draws from Colossal-AI's ``seed(ParallelMode.TENSOR)``
stream.

Inputs follow the docs (F0:6515-6686): chunk dim 0 by ``PARALLEL_2P5D_DEP``, then dim 0 by
``PARALLEL_2P5D_COL``, then the last dim by ``PARALLEL_2P5D_ROW`` (:func:`split_tensor_2p5d`).

Example (8 ranks, ``CONFIG = dict(parallel=dict(tensor=dict(size=8, mode='2.5d', depth=2)))``)::

    from kolossos.legacy.nn.layer.parallel_2p5d import Linear2p5D, split_tensor_2p5d
    fc = Linear2p5D(256, 1024)  # weight torch.Size([128, 512]) on every rank
    y = fc(split_tensor_2p5d(x))  # x (16, 256) -> y (4, 512)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kolossos.legacy.context import ParallelMode
from kolossos.legacy.context.random import seed
from kolossos.legacy.core import global_context as gpc
from kolossos.nn.layer import parallel_2p5d as core
from kolossos.nn.layer.parallel_2p5d import Groups2p5D
from kolossos.nn.layer.parallel_2p5d._init import Initializer
from kolossos.utils import get_current_device

__all__ = [
    "Accuracy2p5D",
    "Classifier2p5D",
    "CrossEntropyLoss2p5D",
    "Dropout2p5D",
    "Embedding2p5D",
    "LayerNorm2p5D",
    "Linear2p5D",
    "PatchEmbedding2p5D",
    "VocabParallelClassifier2p5D",
    "VocabParallelCrossEntropyLoss2p5D",
    "VocabParallelEmbedding2p5D",
    "get_groups_2p5d",
    "reduce_by_batch_2p5d",
    "split_batch_2p5d",
    "split_tensor_2p5d",
]

_MODES = (
    ParallelMode.PARALLEL_2P5D_ROW,
    ParallelMode.PARALLEL_2P5D_COL,
    ParallelMode.PARALLEL_2P5D_DEP,
    ParallelMode.PARALLEL_2P5D_XZ,
    ParallelMode.TENSOR,
)


def get_groups_2p5d() -> Groups2p5D:
    """This rank's tesseract from the launch (no communication).

    Raises:
        RuntimeError: the launch did not create the 2.5D tensor-parallel groups.
    """
    if not all(gpc.is_initialized(mode) for mode in _MODES):
        raise RuntimeError(
            "2.5D tensor-parallel layers need the 2.5D process groups: launch with "
            "config=dict(parallel=dict(tensor=dict(size=8, mode='2.5d', depth=2))) "
            "(size = q*q*depth) first."
        )
    row, col, dep, xz, tensor = (gpc.get_group(mode) for mode in _MODES)
    return Groups2p5D.from_groups(row=row, col=col, dep=dep, xz=xz, tensor=tensor)


def _no_embedding_options(owner: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Colossal-AI forwards ``*args, **kwargs`` to ``F.embedding``; none is supported here."""
    if args or kwargs:
        raise NotImplementedError(
            f"{owner}: F.embedding options {args or ''}{kwargs or ''} (max_norm, "
            "scale_grad_by_freq, sparse) are not supported by the 2.5D embeddings; drop them."
        )


def split_batch_2p5d(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This rank's batch block: ``input_`` chunked by ``PARALLEL_2P5D_DEP``, then by
    ``PARALLEL_2P5D_COL``, along ``dim`` (``d * q`` blocks in all)."""
    return core.split_batch_2p5d(input_, get_groups_2p5d(), dim)


def split_tensor_2p5d(
    input_: torch.Tensor, batch_dim: int = 0, feature_dim: int = -1
) -> torch.Tensor:
    """This rank's activation block: :func:`split_batch_2p5d`, then ``feature_dim`` chunked by
    ``PARALLEL_2P5D_ROW`` — the docs' input partition."""
    return core.split_tensor_2p5d(input_, get_groups_2p5d(), batch_dim, feature_dim)


def reduce_by_batch_2p5d(input_: torch.Tensor, reduce_mean: bool = False) -> torch.Tensor:
    """Sum (or average) a per-batch-block value over the ``d * q`` batch blocks
    (``PARALLEL_2P5D_XZ``). COLLECTIVE."""
    return core.reduce_by_batch_2p5d(input_, get_groups_2p5d(), reduce_mean)


class Linear2p5D(core.Linear2p5D):
    """Colossal-AI's ``Linear2p5D(in_features, out_features, bias=True, dtype=None,
    skip_bias_add=False, weight_initializer=..., bias_initializer=...)``; see
    :class:`kolossos.nn.layer.parallel_2p5d.Linear2p5D`."""

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
            groups=get_groups_2p5d(),
            device=get_current_device(),
        )


class LayerNorm2p5D(core.LayerNorm2p5D):
    """Colossal-AI's ``LayerNorm2p5D(normalized_shape, eps=1e-05, bias=True, dtype=None)``."""

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-05,
        bias: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            normalized_shape,
            eps,
            bias,
            dtype,
            groups=get_groups_2p5d(),
            device=get_current_device(),
        )


class Classifier2p5D(core.Classifier2p5D):
    """Colossal-AI's ``Classifier2p5D(in_features, num_classes, weight=None, bias=True,
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
            groups=get_groups_2p5d(),
            device=get_current_device(),
        )


class VocabParallelClassifier2p5D(core.VocabParallelClassifier2p5D):
    """Colossal-AI's ``VocabParallelClassifier2p5D(in_features, num_classes, weight=None,
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
            groups=get_groups_2p5d(),
            device=get_current_device(),
        )


class Embedding2p5D(core.Embedding2p5D):
    """Colossal-AI's ``Embedding2p5D(num_embeddings, embedding_dim, padding_idx=None,
    dtype=None, weight_initializer=..., *args, **kwargs)`` (``F.embedding`` options in
    ``args`` / ``kwargs`` raise ``NotImplementedError``)."""

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
        _no_embedding_options(type(self).__name__, args, kwargs)
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            dtype,
            weight_initializer,
            groups=get_groups_2p5d(),
            device=get_current_device(),
        )


class VocabParallelEmbedding2p5D(core.VocabParallelEmbedding2p5D):
    """Colossal-AI's ``VocabParallelEmbedding2p5D(num_embeddings, embedding_dim,
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
        _no_embedding_options(type(self).__name__, args, kwargs)
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            dtype,
            weight_initializer,
            groups=get_groups_2p5d(),
            device=get_current_device(),
        )


class PatchEmbedding2p5D(core.PatchEmbedding2p5D):
    """Colossal-AI's ``PatchEmbedding2p5D(img_size, patch_size, in_chans, embed_size,
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
            groups=get_groups_2p5d(),
            device=get_current_device(),
        )


def _tensor_seed() -> Any:
    return seed(ParallelMode.TENSOR)


class Dropout2p5D(core.Dropout2p5D):
    """Dropout on 2.5D activation blocks drawing from ``seed(ParallelMode.TENSOR)`` (what
    ``col_nn.Dropout`` does in Colossal-AI's 2.5D mode)."""

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__(p, inplace, groups=get_groups_2p5d(), rng_context=_tensor_seed)


class CrossEntropyLoss2p5D(core.CrossEntropyLoss2p5D):
    """Colossal-AI's ``CrossEntropyLoss2p5D(reduction=True, *args, **kwargs)`` (``weight``,
    ``ignore_index`` and ``label_smoothing`` by keyword, as ``F.cross_entropy`` takes them)."""

    def __init__(self, reduction: bool = True, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError(
                f"CrossEntropyLoss2p5D: pass F.cross_entropy's options by keyword "
                f"(weight=, ignore_index=, label_smoothing=), not positionally: {args!r}."
            )
        super().__init__(reduction, groups=get_groups_2p5d(), **kwargs)


class VocabParallelCrossEntropyLoss2p5D(core.VocabParallelCrossEntropyLoss2p5D):
    """Colossal-AI's ``VocabParallelCrossEntropyLoss2p5D(reduction=True)``."""

    def __init__(self, reduction: bool = True) -> None:
        super().__init__(reduction, groups=get_groups_2p5d())


class Accuracy2p5D(core.Accuracy2p5D):
    """Colossal-AI's ``Accuracy2p5D()``: correct predictions of the whole batch."""

    def __init__(self) -> None:
        super().__init__(get_groups_2p5d())
