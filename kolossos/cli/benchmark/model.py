"""The benchmark model: Colossal-AI's MLP, a stack of ``Linear(dimension, dimension)`` layers from
``kolossos.nn.Linear`` (which follows the launch config's ``parallel.tensor.mode``), and its
input, a ``(batch, seq_len, dimension)`` tensor cut into this rank's block for the mode.

Build both after ``kolossos.launch`` with the layout's config.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import kolossos.nn as col_nn
from kolossos.cli.benchmark.layouts import Layout
from kolossos.nn.layer.parallel_2d import split_batch_2d
from kolossos.nn.layer.parallel_2p5d import split_tensor_2p5d
from kolossos.nn.layer.parallel_3d import split_batch_3d, split_tensor_3d

__all__ = ["MLP", "make_input", "split_input"]


class MLP(nn.Module):
    """``layers`` linear layers of ``dim`` features, applied in turn (no activation, as in
    Colossal-AI's benchmark: the layers' communication and matmuls are what is measured).

    Args:
        dim: input and output features of every layer.
        layers: number of layers.

    Example:
        >>> kolossos.launch(config=dict(parallel=dict(tensor=dict(size=4, mode='2d'))), ...)
        >>> mlp = MLP(1024, 2)  # two Linear2D(1024, 1024)                 # doctest: +SKIP
    """

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(col_nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run every layer in turn."""
        for layer in self.layers:
            x = layer(x)
        return x


def make_input(
    batch_size: int, seq_len: int, dimension: int, generator: torch.Generator
) -> torch.Tensor:
    """The full input of one step, on the CPU; identical on every rank drawing from a
    generator with the same seed and history."""
    return torch.rand(batch_size, seq_len, dimension, generator=generator)


def split_input(full: torch.Tensor, layout: Layout, model: MLP) -> torch.Tensor:
    """This rank's block of ``full`` for ``layout``, as a tensor of its own (not a view that
    keeps ``full`` alive), on the model's device.

    Data parallel takes batch block ``rank`` of ``N``; 1D takes the whole input; 2D, 2.5D and
    3D take the block their first layer expects (``split_batch_2d`` and the feature block of the
    grid row, ``split_tensor_2p5d``, ``split_batch_3d`` and the feature block of the output
    group), using that layer's own groups.
    """
    first: Any = model.layers[0]
    device = next(model.parameters()).device
    if layout.mode is None:
        block = full.chunk(layout.nproc, dim=0)[dist.get_rank()]
    elif layout.mode == "1d":
        block = full
    elif layout.mode == "2d":
        g = first.groups
        block = split_batch_2d(full, g).chunk(g.q, dim=-1)[g.col_index]
    elif layout.mode == "2.5d":
        block = split_tensor_2p5d(full, first.groups)
    else:
        g = first.groups
        block = split_tensor_3d(split_batch_3d(full, g), -1, g.output)
    return block.to(device=device, copy=True).contiguous()
