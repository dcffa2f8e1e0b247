"""Colossal-AI's 3D tensor-parallel layers (``colossalai.nn.Linear3D``, ...), with their
documented names and signatures, over the groups of the launch.

Launch with ``parallel=dict(tensor=dict(size=q**3, mode='3d'))``; every layer takes this rank's
``ParallelMode.PARALLEL_3D_INPUT`` / ``WEIGHT`` / ``OUTPUT`` / ``INPUT_X_WEIGHT`` /
``OUTPUT_X_WEIGHT`` groups from ``gpc`` — in the roles ``tensor_parallel_env`` currently assigns
them — and is the core layer of :mod:`kolossos.nn.layer.parallel_3d` (same forward, blocks,
``full_state()``). As in Colossal-AI, building a :class:`Linear3D` or a
:class:`VocabParallelClassifier3D` swaps the input and output roles in ``tensor_parallel_env``
(its output is laid out that way), so layers built next take the right groups. Parameters are
created on the current device and initialised as the dense layer (``weight_initializer`` /
``bias_initializer``, when given, fill the full tensor before it is sliced); :class:`Dropout3D`
draws from Colossal-AI's ``seed(ParallelMode.TENSOR)`` stream.

Example (8 ranks, ``CONFIG = dict(parallel=dict(tensor=dict(size=8, mode='3d')))``)::

    from kolossos.legacy.nn.layer.parallel_3d import Linear3D
    dense_1 = Linear3D(256, 1024)  # weight torch.Size([128, 256]) on every rank
    dense_2 = Linear3D(1024, 256)  # weight torch.Size([512, 64])
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.legacy.context import ParallelMode
from kolossos.legacy.context.random import seed
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.global_variables import tensor_parallel_env as env
from kolossos.nn.layer import parallel_3d as core
from kolossos.nn.layer.parallel_3d import Groups3D
from kolossos.nn.layer.parallel_3d._base import Initializer
from kolossos.utils import get_current_device

__all__ = [
    "Accuracy3D",
    "Classifier3D",
    "CrossEntropyLoss3D",
    "Dropout3D",
    "Embedding3D",
    "LayerNorm3D",
    "Linear3D",
    "PatchEmbedding3D",
    "VocabParallelClassifier3D",
    "VocabParallelCrossEntropyLoss3D",
    "VocabParallelEmbedding3D",
    "get_groups_3d",
    "reduce_by_batch_3d",
    "split_batch_3d",
    "split_tensor_3d",
    "swap_in_out_group",
]

_MODES = (
    ParallelMode.PARALLEL_3D_INPUT,
    ParallelMode.PARALLEL_3D_WEIGHT,
    ParallelMode.PARALLEL_3D_OUTPUT,
    ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT,
    ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT,
)


def get_groups_3d() -> Groups3D:
    """This rank's 3D groups from the launch, in the roles ``tensor_parallel_env`` assigns now.

    Raises:
        RuntimeError: the launch did not create 3D tensor-parallel groups.
    """
    if env.depth_3d is None or not all(gpc.is_initialized(mode) for mode in _MODES):
        raise RuntimeError(
            "3D tensor-parallel layers need the 3D process groups: launch with "
            "config=dict(parallel=dict(tensor=dict(size=8, mode='3d'))) (size a cube) first."
        )
    roles = {
        "input": env.input_group_3d,
        "weight": env.weight_group_3d,
        "output": env.output_group_3d,
        "input_x_weight": env.input_x_weight_group_3d,
        "output_x_weight": env.output_x_weight_group_3d,
    }
    return Groups3D(
        **{role: gpc.get_group(mode) for role, mode in roles.items()},
        tensor=gpc.get_group(ParallelMode.TENSOR),
        depth=env.depth_3d,
        input_rank=gpc.get_local_rank(roles["input"]),
        weight_rank=gpc.get_local_rank(roles["weight"]),
        output_rank=gpc.get_local_rank(roles["output"]),
    )


def swap_in_out_group() -> None:
    """Exchange the input and output roles (and the two planes) in ``tensor_parallel_env``, as
    a linear layer does to the layout of its output."""
    env.input_group_3d, env.output_group_3d = env.output_group_3d, env.input_group_3d
    env.input_x_weight_group_3d, env.output_x_weight_group_3d = (
        env.output_x_weight_group_3d,
        env.input_x_weight_group_3d,
    )


class _Modes:
    """Colossal-AI's ``*_parallel_mode`` attributes, recorded from the env at build time."""

    def _record_modes(self) -> None:
        self.input_parallel_mode = env.input_group_3d
        self.weight_parallel_mode = env.weight_group_3d
        self.output_parallel_mode = env.output_group_3d
        self.input_x_weight_parallel_mode = env.input_x_weight_group_3d
        self.output_x_weight_parallel_mode = env.output_x_weight_group_3d


def split_tensor_3d(tensor: torch.Tensor, dim: int, parallel_mode: ParallelMode) -> torch.Tensor:
    """This rank's chunk of ``tensor`` along ``dim`` over ``parallel_mode``'s group."""
    return core.split_tensor_3d(tensor, dim, gpc.get_group(parallel_mode))


def _groups_with(
    input_parallel_mode: ParallelMode | None, weight_parallel_mode: ParallelMode | None
) -> Groups3D:
    groups = get_groups_3d()
    if input_parallel_mode is not None:
        group, rank = gpc.get_group(input_parallel_mode), gpc.get_local_rank(input_parallel_mode)
        groups = replace(groups, input=group, input_rank=rank)
    if weight_parallel_mode is not None:
        group, rank = gpc.get_group(weight_parallel_mode), gpc.get_local_rank(weight_parallel_mode)
        groups = replace(groups, weight=group, weight_rank=rank)
    return groups


def split_batch_3d(
    input_: torch.Tensor,
    dim: int = 0,
    input_parallel_mode: ParallelMode | None = None,
    weight_parallel_mode: ParallelMode | None = None,
) -> torch.Tensor:
    """This rank's batch block: chunked along ``dim`` by the weight group, then by the input
    group (default: the roles of ``tensor_parallel_env`` now, as Colossal-AI reads them)."""
    return core.split_batch_3d(input_, _groups_with(input_parallel_mode, weight_parallel_mode), dim)


def reduce_by_batch_3d(
    tensor: torch.Tensor,
    input_parallel_mode: ParallelMode,
    weight_parallel_mode: ParallelMode,
    reduce_mean: bool = False,
) -> torch.Tensor:
    """Sum (or mean) of ``tensor`` over the input and weight groups. COLLECTIVE."""
    groups = _groups_with(input_parallel_mode, weight_parallel_mode)
    return core.reduce_by_batch_3d(tensor, groups, reduce_mean)


class Linear3D(_Modes, core.Linear3D):
    """Colossal-AI's ``Linear3D(in_features, out_features, bias=True, dtype=None,
    skip_bias_add=False, weight_initializer=..., bias_initializer=...)``; see
    :class:`kolossos.nn.layer.parallel_3d.Linear3D`. Swaps the env's input/output roles."""

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
            groups=get_groups_3d(),
            device=get_current_device(),
        )
        self._record_modes()
        swap_in_out_group()


class LayerNorm3D(_Modes, core.LayerNorm3D):
    """Colossal-AI's ``LayerNorm3D(normalized_shape, eps=1e-12, bias=True, dtype=None)``."""

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-12,
        bias: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, bias, dtype, groups=get_groups_3d(), device=get_current_device()
        )
        self._record_modes()


class Classifier3D(_Modes, core.Classifier3D):
    """Colossal-AI's ``Classifier3D(in_features, num_classes, weight=None, bias=True,
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
            groups=get_groups_3d(),
            device=get_current_device(),
        )
        self._record_modes()


class VocabParallelClassifier3D(_Modes, core.VocabParallelClassifier3D):
    """Colossal-AI's ``VocabParallelClassifier3D(in_features, num_classes, weight=None,
    bias=True, dtype=None, weight_initializer=..., bias_initializer=...)``. Swaps the env's
    input/output roles and sets ``vocab_parallel``."""

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
            groups=get_groups_3d(),
            device=get_current_device(),
        )
        self._record_modes()
        swap_in_out_group()
        env.vocab_parallel = True


class Embedding3D(_Modes, core.Embedding3D):
    """Colossal-AI's ``Embedding3D(num_embeddings, embedding_dim, padding_idx=None,
    dtype=None, weight_initializer=..., *args, **kwargs)``."""

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
            groups=get_groups_3d(),
            device=get_current_device(),
            **kwargs,
        )
        self._record_modes()


class VocabParallelEmbedding3D(_Modes, core.VocabParallelEmbedding3D):
    """Colossal-AI's ``VocabParallelEmbedding3D(num_embeddings, embedding_dim,
    padding_idx=None, dtype=None, weight_initializer=..., *args, **kwargs)``; sets
    ``vocab_parallel``."""

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
            groups=get_groups_3d(),
            device=get_current_device(),
            **kwargs,
        )
        self._record_modes()
        env.vocab_parallel = True


class PatchEmbedding3D(_Modes, core.PatchEmbedding3D):
    """Colossal-AI's ``PatchEmbedding3D(img_size, patch_size, in_chans, embed_size,
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
            groups=get_groups_3d(),
            device=get_current_device(),
        )
        self._record_modes()


class Dropout3D(nn.Dropout):
    """Dropout on 3D-parallel activations (every rank holds different elements) drawn from
    Colossal-AI's ``seed(ParallelMode.TENSOR)`` stream (``seed + tensor rank``), as
    ``colossalai.nn.Dropout`` does in mode ``'3d'``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with seed(ParallelMode.TENSOR):
            return F.dropout(x, self.p, True, self.inplace)


class CrossEntropyLoss3D(core.CrossEntropyLoss3D):
    """Colossal-AI's ``CrossEntropyLoss3D(reduction=True, *args, **kwargs)`` (``kwargs``:
    ``weight``, ``ignore_index``, ``label_smoothing``)."""

    def __init__(self, reduction: bool = True, *args: Any, **kwargs: Any) -> None:
        super().__init__(reduction, *args, groups=get_groups_3d(), **kwargs)


class VocabParallelCrossEntropyLoss3D(core.VocabParallelCrossEntropyLoss3D):
    """Colossal-AI's ``VocabParallelCrossEntropyLoss3D(reduction=True)``."""

    def __init__(self, reduction: bool = True) -> None:
        super().__init__(reduction, groups=get_groups_3d())


class Accuracy3D(core.Accuracy3D):
    """Colossal-AI's ``Accuracy3D()``: the number of correct predictions in the whole batch."""

    def __init__(self) -> None:
        super().__init__(groups=get_groups_3d())
