"""Region entries fused with their column layers' matmuls: sequence parallelism in
``'ring'`` mode and with ``enable_sequence_overlap``.

A plain region entry (:func:`~kolossos.shardformer.hooks.region_entry`) all-gathers the sequence
once and every column layer of the region (q, k, v; gate, up) multiplies the full input. To
overlap that communication with the matmuls, the entry must run the matmuls itself: it calls
:func:`~kolossos.nn.layer.parallel_1d.ring_ops.ring_gather_linears` (``'ring'``) or
:func:`~kolossos.nn.layer.parallel_1d.seq_overlap.overlapped_gather_linears` (``'split_gather'``
with overlap) on the weights of all the region's column layers, hands the region's forward the
gathered input as before, and *stages* each layer's output on the layer. A staged column layer
called with that very input tensor returns its staged output instead of multiplying again; called
with anything else (a model whose forward transforms the input first) it multiplies that input
itself, which is still correct: the gathered input is an output of the fused op, so its
gradient flows back through the same reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d import FusedLinear1D_Col, Linear1D_Col
from kolossos.nn.layer.parallel_1d.ring_ops import ring_gather_linears
from kolossos.nn.layer.parallel_1d.seq_overlap import overlapped_gather_linears

__all__ = [
    "StagedFusedLinear1D_Col",
    "StagedLinear1D_Col",
    "fused_region_entry",
    "uses_fused_regions",
]

TensorFn = Callable[[torch.Tensor], torch.Tensor]


class _Staged(Linear1D_Col):
    """A column layer built with ``input_comm=False`` that returns an output its region's entry
    computed for a given input tensor (once), else computes as usual."""

    _staged: tuple[torch.Tensor, torch.Tensor] | None = None

    def stage(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Keep ``y`` as the output for the next call with ``x`` itself."""
        self._staged = (x, y)

    def forward(self, x: torch.Tensor) -> Any:
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] is x:
            return staged[1]
        return super().forward(x)


class StagedLinear1D_Col(_Staged):
    """:class:`~kolossos.nn.layer.parallel_1d.Linear1D_Col` whose output its fused region entry
    may have computed already (same parameters, names and checkpoints)."""


class StagedFusedLinear1D_Col(_Staged, FusedLinear1D_Col):
    """:class:`~kolossos.nn.layer.parallel_1d.FusedLinear1D_Col` whose output its fused region
    entry may have computed already."""


def uses_fused_regions(sequence_parallel: bool, mode: str, overlap: bool) -> bool:
    """Whether the sharder builds staged column layers and fused region entries: sequence
    parallelism in ``'ring'`` mode, or ``'split_gather'`` with ``enable_sequence_overlap``."""
    return sequence_parallel and (mode == "ring" or overlap)


def fused_region_entry(
    group: ProcessGroup, mode: str, seq_dim: int, columns: Sequence[nn.Module]
) -> TensorFn:
    """The entry of a sequence-parallel region whose column layers are ``columns`` (staged
    layers built with ``input_comm=False``).

    Args:
        group: the tensor-parallel group.
        mode: ``'ring'`` (ring exchanges, each chunk multiplied on arrival) or
            ``'split_gather'`` (all-gather, backward communication overlapped).
        seq_dim: the sequence dimension of the region's input.
        columns: the region's column layers, in the order the forward calls them.

    Raises:
        ValueError: no column layer, or one that is not staged or returns something else than
            its plain output (``gather_output`` / ``skip_bias_add``).
    """
    if not columns:
        raise ValueError("fused_region_entry: the region has no column layer to fuse.")
    staged: list[_Staged] = []
    for layer in columns:
        if not isinstance(layer, _Staged) or layer.gather_output or layer.skip_bias_add:
            raise ValueError(
                f"fused_region_entry: {type(layer).__name__} cannot be fused into its region's "
                "entry; build Staged(Fused)Linear1D_Col layers without gather_output / "
                "skip_bias_add."
            )
        staged.append(layer)
    fuse = ring_gather_linears if mode == "ring" else overlapped_gather_linears

    def entry(x: torch.Tensor) -> torch.Tensor:
        weights = [layer.weight.t() if layer.conv1d_layout else layer.weight for layer in staged]
        biases = [layer.bias for layer in staged]
        full, ys = fuse(x, weights, biases, group, seq_dim)
        for layer, y in zip(staged, ys, strict=True):
            layer.stage(full, y)
        return full

    return entry
