"""Column-parallel linear layer over fused blocks (GPT-2's ``c_attn``: q, k and v in one weight),
where each rank must hold its own heads of every block, not a contiguous slice of the fused
output."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kolossos.nn.layer.parallel_1d._base import GroupArg, reject_positional
from kolossos.nn.layer.parallel_1d._linear_base import native_linear_weights
from kolossos.nn.layer.parallel_1d.initializers import Initializer
from kolossos.nn.layer.parallel_1d.linear import Linear1D_Col

__all__ = ["FusedLinear1D_Col"]


def _equal_sections(owner: str, out_features: int, n_fused: int) -> tuple[int, ...]:
    if isinstance(n_fused, bool) or not isinstance(n_fused, int) or n_fused < 1:
        raise ValueError(f"{owner}: n_fused={n_fused!r} must be a positive int.")
    if out_features % n_fused:
        raise ValueError(
            f"{owner}: out_features={out_features} cannot be cut into n_fused={n_fused} equal "
            "blocks; pass fused_sections=(...) with the block sizes."
        )
    return (out_features // n_fused,) * n_fused


class FusedLinear1D_Col(Linear1D_Col):
    """:class:`Linear1D_Col` whose output features are stacked blocks (``n_fused`` equal ones, or
    ``fused_sections``), each split evenly over the group; rank ``r`` computes
    ``[q_r | k_r | v_r]``. A gathered output (``gather_output=True``) is in the dense layer's
    order ``[q | k | v]``.

    The positional order is Colossal-AI's.

    Args:
        in_features: input size.
        out_features: full output size (the sum of the blocks).
        bias: whether the layer has a bias.
        dtype: dtype of the weights.
        device: where the weights live.
        process_group: the tensor-parallel group (default: the world).
        async_communication: all-reduce the input gradient asynchronously, overlapped with the
            weight gradient (the ``overlap`` of :class:`Linear1D_Col`).
        gather_output: all-gather the output features.
        skip_bias_add: return ``(output, bias)`` without adding the bias.
        n_fused: number of equal blocks when ``fused_sections`` is not given (default 3).
        weight: the full fused weight to shard.
        bias_: the full fused bias.
        weight_initializer: see :class:`Linear1D_Col`.
        bias_initializer: see :class:`Linear1D_Col`.
        fused_sections: the block sizes along the output features (overrides ``n_fused``).
        options: further :class:`Linear1D_Col` keyword arguments (``seq_parallel``,
            ``input_comm``, ``conv1d_layout``, ...).

    Example:
        >>> attn = FusedLinear1D_Col.from_native_module(block.attn.c_attn, group)  # doctest: +SKIP
        >>> local = attn.out_features // 3 // attn.tp_size  # doctest: +SKIP
        >>> q, k, v = attn(hidden).split(local, dim=-1)  # doctest: +SKIP
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
        skip_bias_add: bool = False,
        n_fused: int = 3,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        fused_sections: tuple[int, ...] | None = None,
        **options: Any,
    ) -> None:
        if fused_sections is None:
            fused_sections = _equal_sections(type(self).__name__, out_features, n_fused)
        overlap = bool(options.pop("overlap", None)) or bool(async_communication)
        super().__init__(
            in_features,
            out_features,
            bias,
            dtype,
            device,
            process_group,
            gather_output,
            skip_bias_add=skip_bias_add,
            weight=weight,
            bias_=bias_,
            weight_initializer=weight_initializer,
            bias_initializer=bias_initializer,
            overlap=overlap,
            fused_sections=tuple(fused_sections),
            **options,
        )
        self.n_fused = len(fused_sections)
        self.async_communication = bool(async_communication)

    @classmethod
    def from_native_module(
        cls,
        module: nn.Module,
        process_group: GroupArg = None,
        n_fused: int = 3,
        *args: Any,
        fused_sections: tuple[int, ...] | None = None,
        **kwargs: Any,
    ) -> FusedLinear1D_Col:
        """Build from a fused ``nn.Linear`` or transformers ``Conv1D``.

        Args:
            module: the fused layer.
            process_group: the tensor-parallel group (default: the world).
            n_fused: number of equal blocks when ``fused_sections`` is not given.
            args: not accepted (pass options by keyword).
            fused_sections: the block sizes along the output features.
            kwargs: further constructor keyword arguments.

        Raises:
            ValueError: the output size is not ``n_fused`` equal blocks.
        """
        reject_positional(cls.__name__, args)
        if fused_sections is None:
            out_f = native_linear_weights(module)[1]
            fused_sections = _equal_sections(cls.__name__, out_f, n_fused)
        return super().from_native_module(
            module, process_group, fused_sections=tuple(fused_sections), **kwargs
        )
