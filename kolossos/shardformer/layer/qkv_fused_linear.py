"""Colossal-AI's ``colossalai.shardformer.layer.qkv_fused_linear``: tensor-parallel versions of
GPT-2's fused ``Conv1D`` layers, the fused ``nn.Linear`` (kolossos' own
:class:`~kolossos.nn.layer.parallel_1d.FusedLinear1D_Col`), and the functions cutting a fused
``[Q, K, V]`` tensor into per-rank ``[Q_r, K_r, V_r]`` pieces and gathering them back.

Example:
    >>> c_attn = GPT2FusedLinearConv1D_Col.from_native_module(attn.c_attn, group)  # doctest: +SKIP
    >>> c_proj = GPT2FusedLinearConv1D_Row.from_native_module(attn.c_proj, group)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from kolossos.nn.layer.parallel_1d import (
    FusedLinear1D_Col,
    Linear1D_Row,
    TPShardSpec,
    gather_tp_full,
    is_conv1d,
    slice_tp_shard,
)
from kolossos.nn.layer.parallel_1d._base import GroupArg, reject_positional, resolve_group
from kolossos.nn.layer.parallel_1d.initializers import Initializer

__all__ = [
    "FusedLinear1D_Col",
    "GPT2FusedLinearConv1D_Col",
    "GPT2FusedLinearConv1D_Row",
    "gather_fused_qkv_in_gpt2_style",
    "split_fused_qkv_in_gpt2_style",
]


def _fused_spec(
    full_shape: tuple[int, ...], n_fused: int, group: GroupArg, is_transposed: bool
) -> TPShardSpec:
    """The shard spec of a fused tensor: ``n_fused`` equal blocks along the output features
    (the last dimension when ``is_transposed``, else the first), each split over ``group``."""
    dim = len(full_shape) - 1 if is_transposed else 0
    if isinstance(n_fused, bool) or not isinstance(n_fused, int) or n_fused < 1:
        raise ValueError(f"n_fused={n_fused!r} must be a positive int.")
    if full_shape[dim] % n_fused:
        raise ValueError(
            f"a fused tensor of shape {full_shape} cannot be cut into n_fused={n_fused} equal "
            f"blocks along dimension {dim}."
        )
    sections = (full_shape[dim] // n_fused,) * n_fused
    return TPShardSpec(
        dim=dim, full_shape=full_shape, fused_sections=sections, group=resolve_group(group)
    )


def split_fused_qkv_in_gpt2_style(
    qkv: torch.Tensor, n_fused: int, process_group: GroupArg, is_transposed: bool = False
) -> torch.Tensor:
    """This rank's piece ``[Q_r, K_r, V_r]`` of a full fused tensor ``[Q, K, V]`` (no
    communication).

    Args:
        qkv: the full fused tensor (a weight, bias or gradient).
        n_fused: the number of equal blocks (3 for q, k, v).
        process_group: the tensor-parallel group (``None``: the world).
        is_transposed: ``qkv`` is stored ``(in, out)`` (GPT-2's ``Conv1D``): the blocks lie
            along the last dimension; otherwise along the first.

    Raises:
        ValueError: a block size is not divisible by the group size.
    """
    spec = _fused_spec(tuple(qkv.shape), n_fused, process_group, is_transposed)
    return slice_tp_shard(qkv, spec, dist.get_rank(spec.group))


def gather_fused_qkv_in_gpt2_style(
    qkv: torch.Tensor, n_fused: int, process_group: GroupArg, is_transposed: bool = False
) -> torch.Tensor:
    """The full fused tensor ``[Q, K, V]`` from every rank's ``[Q_r, K_r, V_r]``: the inverse of
    :func:`split_fused_qkv_in_gpt2_style`. COLLECTIVE over ``process_group``."""
    group = resolve_group(process_group)
    dim = qkv.dim() - 1 if is_transposed else 0
    full_shape = list(qkv.shape)
    full_shape[dim] *= dist.get_world_size(group)
    spec = _fused_spec(tuple(full_shape), n_fused, group, is_transposed)
    return gather_tp_full(qkv, spec)


def _conv1d_weights(owner: str, module: nn.Module) -> tuple[int, int, Any, Any]:
    if not is_conv1d(module):
        raise TypeError(
            f"{owner}.from_native_module converts a transformers Conv1D (weight stored "
            f"(in, out)), got {type(module).__name__}; use Linear1D_Col/Row for nn.Linear."
        )
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.shape[0], weight.shape[1], weight, getattr(module, "bias", None)


class GPT2FusedLinearConv1D_Col(FusedLinear1D_Col):
    """Column-parallel GPT-2 ``Conv1D`` with fused blocks (``c_attn``: q, k, v): a
    :class:`FusedLinear1D_Col` whose weight is stored ``(in, out)``. The gathered output
    (``gather_output=True``) is in the dense layer's order.

    Args:
        in_features: input size.
        out_features: full output size (``n_fused`` blocks).
        bias: whether the layer has a bias.
        dtype: dtype of the weights.
        device: where the weights live.
        process_group: the tensor-parallel group (default: the world).
        async_communication: overlap the input-gradient all-reduce with the weight gradient.
        gather_output: all-gather the output features.
        seq_parallel: the input is a sequence shard along dimension 1 (all-gathered here).
        overlap: overlap the backward communication with the weight gradient.
        skip_bias_add: return ``(output, bias)`` without adding the bias.
        n_fused: the number of equal blocks (3).
        weight: the full ``(in, out)`` weight to shard.
        bias_: the full bias.
        weight_initializer: see :class:`~kolossos.nn.layer.parallel_1d.Linear1D_Col`.
        bias_initializer: see :class:`~kolossos.nn.layer.parallel_1d.Linear1D_Col`.
        options: further :class:`FusedLinear1D_Col` keywords (``fused_sections``,
            ``seq_parallel_dim``, ``input_comm``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: GroupArg = None,
        async_communication: bool = False,
        gather_output: bool = False,
        seq_parallel: bool = False,
        overlap: bool = False,
        skip_bias_add: bool = False,
        n_fused: int = 3,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        **options: Any,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            bias,
            dtype,
            device,
            process_group,
            async_communication,
            gather_output,
            skip_bias_add,
            n_fused,
            weight,
            bias_,
            weight_initializer,
            bias_initializer,
            seq_parallel=seq_parallel,
            overlap=overlap,
            conv1d_layout=True,
            **options,
        )

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group: GroupArg = None, *args: Any, **kwargs: Any
    ) -> GPT2FusedLinearConv1D_Col:
        """Build from a transformers ``Conv1D`` (``kwargs``: the constructor's keywords, e.g.
        ``n_fused``, ``gather_output``, ``seq_parallel``).

        Raises:
            TypeError: ``module`` is not a ``Conv1D``, or positional options.
        """
        return _from_conv1d(cls, module, process_group, args, kwargs)


class GPT2FusedLinearConv1D_Row(Linear1D_Row):
    """Row-parallel GPT-2 ``Conv1D`` (``c_proj``): a
    :class:`~kolossos.nn.layer.parallel_1d.Linear1D_Row` whose weight is stored ``(in, out)``.

    Args:
        in_features: full input size.
        out_features: output size.
        bias: whether the layer has a bias (replicated).
        dtype: dtype of the weights.
        device: where the weights live.
        process_group: the tensor-parallel group (default: the world).
        seq_parallel: reduce-scatter the output along dimension 1.
        parallel_input: the input is already split along its last dimension.
        skip_bias_add: return ``(output, bias)`` without adding the bias.
        weight: the full ``(in, out)`` weight to shard.
        bias_: the full bias.
        weight_initializer: see :class:`~kolossos.nn.layer.parallel_1d.Linear1D_Row`.
        bias_initializer: see :class:`~kolossos.nn.layer.parallel_1d.Linear1D_Row`.
        stream_chunk_num: inference only: chunked asynchronous all-reduces.
        options: further :class:`~kolossos.nn.layer.parallel_1d.Linear1D_Row` keywords
            (``seq_parallel_dim``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: GroupArg = None,
        seq_parallel: bool = False,
        parallel_input: bool = True,
        skip_bias_add: bool = False,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        stream_chunk_num: int = 1,
        **options: Any,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            bias,
            dtype,
            device,
            process_group,
            seq_parallel=seq_parallel,
            parallel_input=parallel_input,
            skip_bias_add=skip_bias_add,
            weight=weight,
            bias_=bias_,
            weight_initializer=weight_initializer,
            bias_initializer=bias_initializer,
            stream_chunk_num=stream_chunk_num,
            conv1d_layout=True,
            **options,
        )

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group: GroupArg = None, *args: Any, **kwargs: Any
    ) -> GPT2FusedLinearConv1D_Row:
        """Build from a transformers ``Conv1D`` (``kwargs``: the constructor's keywords, e.g.
        ``parallel_input``, ``seq_parallel``).

        Raises:
            TypeError: ``module`` is not a ``Conv1D``, or positional options.
        """
        return _from_conv1d(cls, module, process_group, args, kwargs)


_C = TypeVar("_C", bound=nn.Module)


def _from_conv1d(
    cls: type[_C], module: nn.Module, process_group: GroupArg, args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> _C:  # fmt: skip
    """``cls`` built from transformers ``Conv1D`` ``module``'s sizes and full weights."""
    reject_positional(cls.__name__, args)
    in_f, out_f, weight, bias = _conv1d_weights(cls.__name__, module)
    return cls(
        in_f,
        out_f,
        bias is not None,
        process_group=process_group,
        weight=weight,
        bias_=bias,
        **kwargs,
    )
