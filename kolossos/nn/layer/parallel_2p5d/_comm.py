"""Autograd collectives and batch helpers of 2.5D tensor parallelism.

=================================  ==========================  ==========================
function                           forward                     backward
=================================  ==========================  ==========================
:func:`replicated_param`           identity                    all-reduce over ``group``
:func:`reduce_over`                all-reduce over ``group``   identity
:func:`gather_param`               all-gather along ``dim``    reduce-scatter along ``dim``
:func:`reduce_scatter_batch`       reduce-scatter along 0      all-gather along 0
=================================  ==========================  ==========================

``replicated_param`` is how a parameter replicated over some ranks (a depth replica, a bias
shared by every batch block) enters a computation on a part of the batch: each replica's
gradient becomes the sum over all of them, i.e. the dense gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._comm import (
    all_gather_along,
    copy_to_tp,
    gather_seq_reduce_scatter_grad,
    reduce_from_tp,
    reduce_scatter_seq_gather_grad,
)
from kolossos.nn.layer.parallel_2p5d.groups import Groups2p5D

__all__ = [
    "gather_param",
    "gather_tensor_2p5d",
    "reduce_by_batch_2p5d",
    "reduce_over",
    "reduce_scatter_batch",
    "replicated_param",
    "split_batch_2p5d",
    "split_tensor_2p5d",
]


def replicated_param(param: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``param`` unchanged; its gradient is summed over ``group`` in backward (COLLECTIVE)."""
    if dist.get_world_size(group) == 1:
        return param
    return copy_to_tp(param, group)


def reduce_over(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (COLLECTIVE); the gradient passes through unchanged."""
    if dist.get_world_size(group) == 1:
        return x
    return reduce_from_tp(x, group)


def gather_param(param: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenation along ``dim`` over ``group`` (COLLECTIVE); backward sums the gradient over
    ``group`` and keeps this rank's slice (reduce-scatter)."""
    if dist.get_world_size(group) == 1:
        return param
    return gather_seq_reduce_scatter_grad(param, group, dim)


def reduce_scatter_batch(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's slice of dim 0 (COLLECTIVE); backward all-gathers
    the gradient along dim 0."""
    if dist.get_world_size(group) == 1:
        return x
    return reduce_scatter_seq_gather_grad(x, group, 0)


def _check_parts(x: torch.Tensor, dim: int, parts: int, what: str) -> None:
    if x.shape[dim] % parts:
        raise ValueError(
            f"{what}: dimension {dim} of the tensor of shape {tuple(x.shape)} has size "
            f"{x.shape[dim]}, not divisible by {parts}; make it a multiple of {parts}."
        )


def split_batch_2p5d(x: torch.Tensor, groups: Groups2p5D, dim: int = 0) -> torch.Tensor:
    """This rank's batch block of ``x`` (identical on every rank): ``x`` cut into ``d * q``
    blocks along ``dim``, block ``depth_index * q + row_index`` — the docs' chunk by
    ``PARALLEL_2P5D_DEP`` then by ``PARALLEL_2P5D_COL``. No communication; the gradient reaches
    only this block.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by ``d * q``.

    Example:
        >>> x_blk = split_batch_2p5d(torch.randn(16, 256), groups)  # (4, 256)  # doctest: +SKIP
    """
    _check_parts(x, dim, groups.batch_parts, "split_batch_2p5d")
    return x.chunk(groups.batch_parts, dim=dim)[groups.batch_index]


def split_tensor_2p5d(
    x: torch.Tensor, groups: Groups2p5D, batch_dim: int = 0, feature_dim: int = -1
) -> torch.Tensor:
    """This rank's activation block of ``x`` (identical on every rank): the batch block of
    :func:`split_batch_2p5d`, then feature block ``col_index`` of ``q`` along ``feature_dim``
    (the docs' chunk by ``PARALLEL_2P5D_ROW``). What a :class:`Linear2p5D` takes. No
    communication.

    Example:
        >>> x_blk = split_tensor_2p5d(torch.randn(16, 256), groups)  # (4, 128)  # doctest: +SKIP
    """
    x = split_batch_2p5d(x, groups, batch_dim)
    _check_parts(x, feature_dim, groups.tesseract_dim, "split_tensor_2p5d")
    return x.chunk(groups.tesseract_dim, dim=feature_dim)[groups.col_index]


def gather_tensor_2p5d(
    x: torch.Tensor, groups: Groups2p5D, batch_dim: int = 0, feature_dim: int | None = -1
) -> torch.Tensor:
    """The full tensor from every rank's activation block (the inverse of
    :func:`split_tensor_2p5d`; ``feature_dim=None``: features are not split). COLLECTIVE over
    the tensor group; no autograd."""
    out = x.detach()
    if feature_dim is not None:
        out = all_gather_along(out, feature_dim % out.dim(), groups.row)
    return all_gather_along(out, batch_dim % out.dim(), groups.xz)


def reduce_by_batch_2p5d(
    x: torch.Tensor, groups: Groups2p5D, reduce_mean: bool = False
) -> torch.Tensor:
    """Sum (or mean, ``reduce_mean``) of ``x`` over the ``d * q`` batch blocks (the ``xz``
    group). COLLECTIVE; the gradient passes through (divided by ``d * q`` for the mean).

    Example:
        >>> total = reduce_by_batch_2p5d(local_loss_sum, groups)  # doctest: +SKIP
    """
    out = reduce_over(x, groups.xz)
    return out / groups.batch_parts if reduce_mean else out
