"""Colossal-AI's config-driven layers: ``kolossos.nn.Linear``, ``Dropout``, ``Embedding``,
``LayerNorm`` and the loss ``CrossEntropyLoss``.

Each reads ``parallel.tensor`` of the launch config when it is built. Without tensor parallelism
it is the plain torch layer; in ``'1d'`` mode consecutive ``Linear`` layers alternate column- and
row-parallel (the output of a column layer stays split and feeds the next, row-parallel, layer),
and ``Dropout`` after a column layer draws independent masks per rank. In ``'2d'``, ``'2.5d'``
and ``'3d'`` mode each is that mode's layer (``Linear2D``, ``Linear2p5D``, ``Linear3D`` ...,
:mod:`kolossos.legacy.nn.layer`), whose input is this rank's block of the batch (the caller
splits it, e.g. with ``split_batch_2d``). Layers are created on
:func:`kolossos.utils.get_current_device`.

Example (``CONFIG = dict(parallel=dict(tensor=dict(size=2, mode='1d')))``, 2 ranks)::

    import kolossos.nn as col_nn
    dense_1 = col_nn.Linear(256, 1024)  # Linear1D_Col: weight (512, 256) per rank
    dense_2 = col_nn.Linear(1024, 256)  # Linear1D_Row: weight (256, 512) per rank
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kolossos.legacy.nn.layer.modes import ModeLayers, mode_layers
from kolossos.legacy.tensor_parallel import (
    TensorParallelSettings,
    get_parallel_input,
    get_tensor_parallel_group,
    read_tensor_parallel_settings,
    set_parallel_input,
)
from kolossos.nn.layer.parallel_1d import (
    Dropout1D,
    Embedding1D,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
)
from kolossos.utils import get_current_device

__all__ = ["CrossEntropyLoss", "Dropout", "Embedding", "LayerNorm", "Linear"]


def _device() -> torch.device:
    return get_current_device()


def _settings() -> tuple[TensorParallelSettings | None, ModeLayers | None]:
    """``(settings, None)`` in 1D mode, ``(None, layers)`` in a multi-dimensional mode,
    ``(None, None)`` without tensor parallelism."""
    settings = read_tensor_parallel_settings()
    if settings.mode is None:
        return None, None
    if settings.mode == "1d":
        return settings, None
    layers = mode_layers(settings.mode)
    assert layers is not None  # TensorParallelSettings checked the mode
    return None, layers


def Linear(
    in_features: int,
    out_features: int,
    bias: bool = True,
    dtype: torch.dtype | None = None,
    gather_output: bool = False,
    skip_bias_add: bool = False,
) -> nn.Module:
    """A linear layer following the launch config's tensor parallelism.

    Args:
        in_features: input size.
        out_features: output size.
        bias: whether the layer has a bias.
        dtype: parameter dtype.
        gather_output: (1D) make a column-parallel layer gather its output; the next layer then
            takes a replicated input.
        skip_bias_add: (1D) return ``(output, bias)`` without adding the bias.

    Returns:
        ``nn.Linear`` without tensor parallelism; in 1D mode a ``Linear1D_Col`` when the input
        is replicated (and ``gather_output`` is off), else a ``Linear1D_Row`` over the split input;
        ``Linear2D`` / ``Linear2p5D`` / ``Linear3D`` in the other modes.

    Raises:
        ValueError: ``gather_output`` outside 1D mode, or ``skip_bias_add`` without tensor
            parallelism.
    """
    settings, layers = _settings()
    if layers is not None:
        if gather_output:
            raise ValueError(
                "gather_output applies to 1D tensor parallelism only; in 2d/2.5d/3d mode every "
                "Linear takes and returns blocks of the batch: drop gather_output."
            )
        return layers.linear(in_features, out_features, bias, dtype, skip_bias_add)
    if settings is None:
        if gather_output or skip_bias_add:
            raise ValueError(
                "gather_output / skip_bias_add only apply under tensor parallelism; drop them or "
                "set parallel.tensor in the launch config."
            )
        return nn.Linear(in_features, out_features, bias, device=_device(), dtype=dtype)
    group = get_tensor_parallel_group(settings)
    parallel_input = get_parallel_input()
    common = dict(device=_device(), dtype=dtype, process_group=group, skip_bias_add=skip_bias_add)
    layer: nn.Module
    if not parallel_input and not gather_output:
        layer = Linear1D_Col(in_features, out_features, bias, **common)  # type: ignore[arg-type]
        set_parallel_input(True)
    else:
        layer = Linear1D_Row(
            in_features,
            out_features,
            bias,
            parallel_input=parallel_input,
            **common,  # type: ignore[arg-type]
        )
        set_parallel_input(False)
    return layer


def Dropout(p: float = 0.5, inplace: bool = False) -> nn.Module:
    """Dropout following the launch config: ``nn.Dropout`` without tensor parallelism; in 1D
    mode a ``Dropout1D`` with independent masks per rank when it follows a column-parallel layer
    (split activations) and identical masks otherwise; the mode's dropout (independent masks,
    drawn from the TENSOR seed) in 2d/2.5d/3d mode."""
    settings, layers = _settings()
    if layers is not None:
        return layers.dropout(p, inplace)
    if settings is None:
        return nn.Dropout(p, inplace)
    group = get_tensor_parallel_group(settings)
    return Dropout1D(p, inplace, parallel_input=get_parallel_input(), process_group=group)


def Embedding(
    num_embeddings: int,
    embedding_dim: int,
    padding_idx: int | None = None,
    dtype: torch.dtype | None = None,
    vocab_parallel_limit: int = 2048,
) -> nn.Module:
    """An embedding following the launch config: ``nn.Embedding`` without tensor parallelism;
    in 1D mode split over the embedding dimension (``Embedding1D``) for vocabularies up to
    ``vocab_parallel_limit`` rows, over the vocabulary (``VocabParallelEmbedding1D``) above; in
    2d/2.5d/3d mode the mode's ``Embedding`` / ``VocabParallelEmbedding`` by the same rule."""
    settings, layers = _settings()
    if layers is not None:
        vocab = num_embeddings > vocab_parallel_limit
        make = layers.vocab_embedding if vocab else layers.embedding
        return make(num_embeddings, embedding_dim, padding_idx, dtype)
    if settings is None:
        return nn.Embedding(
            num_embeddings, embedding_dim, padding_idx, device=_device(), dtype=dtype
        )
    group = get_tensor_parallel_group(settings)
    if num_embeddings <= vocab_parallel_limit:
        return Embedding1D(
            num_embeddings,
            embedding_dim,
            padding_idx,
            device=_device(),
            dtype=dtype,
            process_group=group,
        )
    return VocabParallelEmbedding1D(
        num_embeddings,
        embedding_dim,
        padding_idx,
        device=_device(),
        dtype=dtype,
        process_group=group,
        make_vocab_size_divisible_by=1,
    )


def LayerNorm(
    normalized_shape: int, eps: float = 1e-05, bias: bool = True, dtype: torch.dtype | None = None
) -> nn.Module:
    """Layer normalisation: in 1D mode the activations it sees are replicated, so this is
    ``nn.LayerNorm`` there and without tensor parallelism; the mode's ``LayerNorm`` (over hidden
    blocks) in 2d/2.5d/3d mode."""
    _, layers = _settings()
    if layers is not None:
        return layers.layer_norm(normalized_shape, eps, bias, dtype)
    return nn.LayerNorm(normalized_shape, eps, bias=bias, device=_device(), dtype=dtype)


def CrossEntropyLoss(reduction: bool = True, **kwargs: Any) -> nn.Module:
    """The loss following the launch config: the legacy layers never split the class
    dimension in 1D mode (logits reach the loss whole), so this is ``nn.CrossEntropyLoss`` without
    tensor parallelism and in 1D mode; the mode's ``CrossEntropyLoss`` (logits and targets in
    batch blocks, the mean over the whole batch) in 2d/2.5d/3d mode.

    Args:
        reduction: ``True``: the mean over the batch; ``False``: one loss per sample.
        kwargs: further ``nn.CrossEntropyLoss`` arguments (``label_smoothing``, ``ignore_index``,
            ``weight``).
    """
    _, layers = _settings()
    if "reduction" in kwargs:
        raise TypeError("pass reduction=True/False (mean or per sample), not a string.")
    if layers is not None:
        return layers.cross_entropy(reduction, **kwargs)
    return nn.CrossEntropyLoss(reduction="mean" if reduction else "none", **kwargs)
