"""Pieces the model-zoo modules share: the launch's tensor mode, weight initialisation by the
*logical* (unsplit) shape so a tensor-parallel shard gets the values its dense twin's slice would
have in distribution, stochastic depth, and the ``checkpoint=`` base class of the blocks."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kolossos.legacy.nn.layer.modes import ModeLayers, mode_layers
from kolossos.legacy.tensor_parallel import read_tensor_parallel_settings
from kolossos.nn.layer.parallel_1d.sharding import get_tp_spec, slice_tp_shard
from kolossos.utils.activation_checkpoint import checkpoint as checkpoint_fn

__all__ = [
    "INIT_METHODS",
    "CheckpointModule",
    "DropPath",
    "check_init_method",
    "init_linear",
    "nd_layers",
    "tensor_mode",
]

INIT_METHODS = ("torch", "jax")
"""``init_method`` values: ``'torch'`` keeps PyTorch's default initialisation of each layer;
``'jax'`` uses the JAX/Flax ViT scheme (Xavier-uniform weights, tiny normal MLP biases, zero
head)."""


def tensor_mode() -> str | None:
    """The launch config's ``parallel.tensor.mode`` (``None``: no tensor parallelism)."""
    return read_tensor_parallel_settings().mode


def nd_layers() -> ModeLayers | None:
    """The layer classes of the launch's 2d / 2.5d / 3d mode, ``None`` in 1D or without TP."""
    return mode_layers(tensor_mode())


def check_init_method(init_method: str) -> None:
    """Raises ValueError for an ``init_method`` other than ``'torch'`` / ``'jax'``."""
    if init_method not in INIT_METHODS:
        raise ValueError(f"init_method={init_method!r} must be one of {INIT_METHODS}.")


def _fill(tensor: torch.Tensor, draw: Callable[[torch.Tensor], Any]) -> None:
    """Fill ``tensor`` with ``draw``; a 1D tensor-parallel shard gets its slice of a full-size
    draw, so every rank consumes the same random numbers and the shards assemble to exactly what
    the dense layer would draw from the same generator state."""
    spec = get_tp_spec(tensor)
    if spec is None:
        draw(tensor)
        return
    full = torch.empty(spec.full_shape, dtype=tensor.dtype, device=tensor.device)
    draw(full)
    tensor.copy_(slice_tp_shard(full, spec, dist.get_rank(spec.group)))


@torch.no_grad()
def init_linear(
    layer: nn.Module, fan_in: int, fan_out: int, init_method: str, *, bias_std: float = 0.0
) -> None:
    """Initialise a (possibly tensor-parallel) linear layer by its logical ``fan_in``/``fan_out``.

    ``'torch'`` leaves the layer as built. ``'jax'`` draws the weight from Xavier-uniform of the
    full shape and the bias from ``N(0, bias_std)`` (zeros when ``bias_std`` is 0); under 1D
    tensor parallelism each rank keeps its slice of the full draw (the same values as the dense
    layer from the same seed).
    """
    if init_method == "torch":
        return
    weight = getattr(layer, "weight", None)
    if isinstance(weight, torch.Tensor):
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        _fill(weight, lambda t: t.uniform_(-bound, bound))
    bias = getattr(layer, "bias", None)
    if isinstance(bias, torch.Tensor):
        if bias_std:
            _fill(bias, lambda t: t.normal_(0.0, bias_std))
        else:
            bias.zero_()


class DropPath(nn.Module):
    """Stochastic depth: in training, zero a whole sample's residual branch with probability
    ``drop_prob`` and scale the kept ones by ``1 / (1 - drop_prob)``."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(f"DropPath: drop_prob={drop_prob} must be in [0, 1).")
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask / keep


class CheckpointModule(nn.Module):
    """A block whose ``forward`` runs :meth:`_forward` under activation checkpointing
    (:func:`kolossos.utils.checkpoint`) when built with ``checkpoint=True`` and in training mode
    with gradients enabled; otherwise it calls :meth:`_forward` directly.

    Args:
        checkpoint: recompute this block's activations in backward instead of keeping them.
        activation_offload: also keep the block's saved inputs in host memory (GPU only).
    """

    def __init__(self, checkpoint: bool = False, activation_offload: bool = False) -> None:
        super().__init__()
        self.checkpoint = bool(checkpoint)
        self.activation_offload = bool(activation_offload)

    def _forward(self, *args: Any) -> Any:
        raise NotImplementedError

    def forward(self, *args: Any) -> Any:
        if self.checkpoint and self.training and torch.is_grad_enabled():
            return checkpoint_fn(self._forward, self.activation_offload, *args)
        return self._forward(*args)
