"""Column-parallel linear layer over fused blocks (GPT-2's ``c_attn``: q, k and v in one weight),
where each rank must hold its own heads of every block, not a contiguous slice of the fused
output."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d.linear import Linear1D_Col, native_linear_weights

__all__ = ["FusedLinear1D_Col"]


class FusedLinear1D_Col(Linear1D_Col):
    """:class:`Linear1D_Col` whose output features are ``fused_sections`` stacked blocks, each
    split evenly over the group; rank ``r`` computes ``[q_r | k_r | v_r]``.

    Built like :class:`Linear1D_Col`; ``fused_sections`` defaults to three equal blocks.

    Example:
        >>> attn = FusedLinear1D_Col.from_native_module(block.attn.c_attn, group)  # doctest: +SKIP
        >>> local = attn.out_features // 3 // attn.tp_size  # doctest: +SKIP
        >>> q, k, v = attn(hidden).split(local, dim=-1)  # doctest: +SKIP
    """

    @classmethod
    def from_native_module(
        cls,
        module: nn.Module,
        process_group: ProcessGroup | None = None,
        *,
        fused_sections: tuple[int, ...] | None = None,
        n_fused: int = 3,
        **options: Any,
    ) -> FusedLinear1D_Col:
        """Build from a fused ``nn.Linear`` or transformers ``Conv1D``.

        Args:
            module: the fused layer.
            process_group: the tensor-parallel group (default: the world).
            fused_sections: the block sizes along the output features; default ``n_fused``
                equal blocks.
            n_fused: number of equal blocks when ``fused_sections`` is not given.
            options: further :class:`Linear1D_Col` keyword arguments.

        Raises:
            ValueError: the output size is not ``n_fused`` equal blocks.
        """
        if fused_sections is None:
            out_f = native_linear_weights(module)[1]
            if n_fused < 1 or out_f % n_fused:
                raise ValueError(
                    f"FusedLinear1D_Col: out_features={out_f} cannot be cut into n_fused={n_fused} "
                    "equal blocks; pass fused_sections=(...) with the block sizes."
                )
            fused_sections = (out_f // n_fused,) * n_fused
        return super().from_native_module(
            module, process_group, fused_sections=tuple(fused_sections), **options
        )
