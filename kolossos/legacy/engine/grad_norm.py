"""The global gradient norm under the legacy tensor and pipeline parallelism, for
``clip_grad_norm``.

Each rank holds a tensor-parallel shard of some parameters and the layers of one pipeline
stage, so the norm of the whole model sums the shards' ``|g|^p`` over ``ParallelMode.TENSOR``
and the stages' totals over ``ParallelMode.PIPELINE``; a parameter shared between stages
(``PipelineSharedModuleWrapper``) is counted once. The layers of every tensor mode mark their
shards, read here through one contract
(:func:`~kolossos.nn.layer.shard_layout.get_shard_layout`): each element of a shard is held by
``layout.replicas`` ranks of the tensor group (1 for 1D and 2D, more for the replicated pieces of
2.5D and 3D), so its ``|g|^p`` enters weighted by ``1 / replicas``. Unmarked parameters are
replicated over the tensor group and counted as one copy. The data-parallel replicas hold the
same (already reduced) gradients and take no part.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from kolossos.cluster.collectives import comm_device
from kolossos.hybrid.grad_norm import tp_global_norm
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.nn.layer.shard_layout import get_shard_layout
from kolossos.pipeline.shared import is_pp_duplicate

__all__ = ["ModelParallelGradNorm", "model_parallel_grad_norm"]


def _piece(grad: torch.Tensor, param: torch.Tensor, norm_type: float) -> tuple[torch.Tensor, bool]:
    """``(gradient as it enters the sum, whether it is summed over the tensor group)``: a shard
    held by ``replicas`` ranks enters with ``|g|^p`` scaled by ``1 / replicas`` (the max of the
    inf-norm needs no scaling)."""
    layout = get_shard_layout(param)
    if layout is None:
        return grad, False
    if layout.replicas == 1 or math.isinf(norm_type):
        return grad, True
    return grad * (1.0 / layout.replicas) ** (1.0 / norm_type), True


def _group(mode: ParallelMode) -> dist.ProcessGroup | None:
    if not gpc.is_initialized(mode) or gpc.get_world_size(mode) == 1:
        return None
    return gpc.get_group(mode)


class ModelParallelGradNorm:
    """A :class:`~kolossos.interface.protocols.GradNormFn` over the tensor and pipeline groups.

    Args:
        tp_group: the tensor-parallel group (``None``: no tensor parallelism).
        pp_group: the pipeline group (``None``: one stage).

    Example:
        >>> optimizer.grad_norm_fn = model_parallel_grad_norm()  # doctest: +SKIP
        >>> optimizer.clip_grad_by_norm(1.0)  # the whole model's norm, on every rank
    """

    def __init__(
        self, tp_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None
    ) -> None:
        self.tp_group = tp_group
        self.pp_group = pp_group

    def __call__(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], norm_type: float
    ) -> torch.Tensor:
        """The whole model's ``norm_type``-norm (COLLECTIVE over the tensor, then the pipeline
        group)."""
        pieces = [_piece(grad, param, norm_type) for grad, param in pairs
                  if not is_pp_duplicate(param)]  # fmt: skip
        device = comm_device(self.tp_group if self.tp_group is not None else self.pp_group)
        return tp_global_norm(
            pieces, norm_type, self.tp_group, device=device, pp_group=self.pp_group
        )


def model_parallel_grad_norm() -> ModelParallelGradNorm | None:
    """The norm over ``gpc``'s TENSOR and PIPELINE groups, or ``None`` when the launch made
    neither (the local norm is then the global one)."""
    tp, pp = _group(ParallelMode.TENSOR), _group(ParallelMode.PIPELINE)
    if tp is None and pp is None:
        return None
    return ModelParallelGradNorm(tp, pp)
