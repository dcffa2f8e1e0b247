"""The global gradient norm under the legacy tensor and pipeline parallelism, for
``clip_grad_norm``.

Each rank holds a tensor-parallel shard of some parameters and the layers of one pipeline
stage, so the norm of the whole model sums the shards' ``|g|^p`` over ``ParallelMode.TENSOR``
and the stages' totals over ``ParallelMode.PIPELINE``; a parameter shared between stages
(``PipelineSharedModuleWrapper``) is counted once. The layers of every tensor mode mark their
shards: 1D and 2D shards hold each element on one rank of the tensor group; 2.5D and 3D shards
are held by ``replicas`` ranks, so their ``|g|^p`` enters weighted by ``1 / replicas``
(``norm_share_*``). Unmarked parameters are replicated over the tensor group and counted as one
copy. The data-parallel replicas hold the same (already reduced) gradients and take
no part.
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
from kolossos.nn.layer.parallel_1d.sharding import get_tp_spec
from kolossos.nn.layer.parallel_2d import norm_share_2d
from kolossos.nn.layer.parallel_2p5d import norm_share_2p5d
from kolossos.nn.layer.parallel_3d import norm_share_3d
from kolossos.pipeline.shared import is_pp_duplicate

__all__ = ["ModelParallelGradNorm", "model_parallel_grad_norm"]


_SHARES = (norm_share_2d, norm_share_2p5d, norm_share_3d)


def _piece(grad: torch.Tensor, param: torch.Tensor, norm_type: float) -> tuple[torch.Tensor, bool]:
    """``(gradient as it enters the sum, whether it is summed over the tensor group)``."""
    if get_tp_spec(param) is not None:
        return grad, True
    for share_of in _SHARES:
        share = share_of(param)
        if share is not None:
            if share == 1.0 or math.isinf(norm_type):
                return grad, True
            return grad * share ** (1.0 / norm_type), True
    return grad, False


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
